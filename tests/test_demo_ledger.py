"""The demo's measured ledger (torch_budget/demo/ledger.py) over the host stand-in: every byte
torch_budget reserved is on one line of it, once."""
import pytest

import torch_budget
from _hostcore import MiB, S1, S2, Host, isolated, python_api_over

pytestmark = pytest.mark.built("_host_core")


@isolated
def test_the_demo_ledger_counts_a_block_kept_in_a_graph_pool_once():
    # A graph pool's live blocks are charged to the tag the pool was made under ('graphs'), and
    # the pool line was the pool's whole reservation: such a block was on both lines.
    from torch_budget.demo.ledger import measured_lines
    from torch_budget.report import measure

    host = Host(configure=False)
    python_api_over(host)
    torch_budget.install(route="vmm")
    with torch_budget.region("graphs"):
        host.malloc(1 * MiB, S1)              # a static buffer, outside the pool
        host.begin_pool((1, 0), S2)
        host.malloc(3 * MiB, S2)              # an output the graph keeps in its pool
        host.free(host.malloc(2 * MiB, S2))   # a temporary of the capture
        host.end_pool((1, 0))
    st = torch_budget.stats()
    assert st["by_tag"]["graphs"]["allocated"] == 4 * MiB and st["graph_pools"] > 3 * MiB

    class Watch:
        peak_used = reserved_at_peak = st["reserved"]

    lines = measured_lines(None, 0, "torch_budget", total=1024 * MiB, weights=0, kv=0, graph_static=0,
                           pools=measure.graph_pool_bytes(0, True), ws_peak=0, peak_allocated=0, watch=Watch())
    by = {line.category: line.bytes for line in lines}
    assert by["graph_workspace"] == 4 * MiB and by["graph_pools"] == st["graph_pools"] - 3 * MiB, by
    # What torch_budget reserved, explained once: no line beyond it, nothing of it left out.
    assert sum(n for c, n in by.items() if c != "headroom") == st["reserved"], by
