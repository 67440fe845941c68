"""The ledger report: where every byte of a card goes, as a table and a picture, and
the code that measures it on a running device. The ledger lines and their text table are
the planner's (torch_budget.planner.ledger); they are exported here too.

- ledger.py: a ledger from measured numbers, and one read back from JSON;
- picture.py: the stacked-bar PNG (needs matplotlib, the `plot` extra);
- measure.py: reading a device (torch's counters, device-wide use, graph pools, tag states).
"""

from torch_budget.planner.ledger import CATEGORIES, LedgerLine, format_table
from torch_budget.report.ledger import load_ledger, measured_ledger
from torch_budget.report.measure import DeviceWatch, Reading, graph_pool_bytes, read, tag_bytes, tag_state
from torch_budget.report.picture import write_png

__all__ = ["CATEGORIES", "LedgerLine", "format_table", "load_ledger", "measured_ledger", "write_png",
           "DeviceWatch", "Reading", "graph_pool_bytes", "read", "tag_bytes", "tag_state"]
