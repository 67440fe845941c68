"""Allocation traces and their replay under several allocators side by side
(`torch-budget replay TRACE`): what install() costs and saves on a user's own workload."""

from torch_budget.replay.trace import Trace, TraceError, from_snapshot, load

__all__ = ["Trace", "TraceError", "from_snapshot", "load"]
