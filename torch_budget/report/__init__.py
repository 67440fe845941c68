"""The ledger report: where every byte of a card goes, as a table and a picture, and
the code that measures it on a running device.

- ledger.py: ledger lines and categories, the text table, the JSON form;
- picture.py: the stacked-bar PNG (needs matplotlib, the `plot` extra);
- measure.py: reading a device (torch's counters, device-wide use, graph pools, tag states).
"""

from torch_budget.report.ledger import CATEGORIES, LedgerLine, format_table, load_ledger, measured_ledger
from torch_budget.report.measure import DeviceWatch, Reading, graph_pool_bytes, read, tag_bytes, tag_state
from torch_budget.report.picture import write_png

__all__ = ["CATEGORIES", "LedgerLine", "format_table", "load_ledger", "measured_ledger", "write_png",
           "DeviceWatch", "Reading", "graph_pool_bytes", "read", "tag_bytes", "tag_state"]
