"""The ledger report: where every byte of a card goes, as a table and a picture, and
the code that measures it on a running device. The ledger lines and their text table are
the planner's (torch_budget.planner.ledger); they are exported here too.

- ledger.py: a ledger from measured numbers, and one written to and read back from JSON;
- picture.py: the stacked-bar PNG (needs matplotlib, the `plot` extra);
- measure.py: reading a device (torch's counters, device-wide use, graph pools, tag states,
  tag budgets).

Tags with budgets of their own (`TagBudget`: budget, use, headroom, peak) are a table beside
the lines (`format_table(..., budgets=)`) and a panel of the picture (`write_png(..., budgets=)`).
"""

from torch_budget.planner.ledger import CATEGORIES, LedgerLine, TagBudget, format_budgets, format_table
from torch_budget.report.ledger import ledger_json, load_ledger, load_report, measured_ledger
from torch_budget.report.measure import (DeviceWatch, Reading, graph_pool_bytes, read, tag_budgets, tag_bytes,
                                         tag_state)
from torch_budget.report.picture import write_png

__all__ = ["CATEGORIES", "LedgerLine", "TagBudget", "format_budgets", "format_table", "ledger_json", "load_ledger",
           "load_report", "measured_ledger", "write_png", "DeviceWatch", "Reading", "graph_pool_bytes", "read",
           "tag_budgets", "tag_bytes", "tag_state"]
