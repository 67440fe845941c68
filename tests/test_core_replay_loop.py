"""The host core's C replay loop (tb_host_replay), which tools/sim_alloc.py times the core by:
it must do what the trace says, continue one program across calls, and refuse what it cannot
replay without losing what it did."""
import pytest

from _hostcore import GiB, MiB, Host, in_child
from torch_budget.replay.trace import Trace

pytestmark = pytest.mark.built("_host_core")


def two_streams():
    t = Trace("t")
    t.alloc(0, 3 * MiB, 0)
    t.alloc(1, 1000, 1)
    t.free(0)
    t.alloc(2, 5 * MiB, 1)
    return t  # 1 and 2 stay live


def replays_as_the_trace_says():
    h = Host(capacity=4 * GiB, route="vmm")
    t = two_streams()
    replay = h.replayer(t, [h.stream(), h.stream()])
    assert replay() >= 0
    s = h.stats()
    after_one = (s["allocation"]["all"]["allocated"], s["allocation"]["all"]["current"], h.allocated())
    replay.free_all()
    assert h.allocated() == 0
    assert replay() >= 0  # a second pass over the freed slots
    replay.free_all()
    s = h.stats()
    return after_one, s["allocation"]["all"]["allocated"], s["allocation"]["all"]["current"]


def test_the_loop_allocates_and_frees_what_the_trace_says():
    (allocs, live, live_bytes), total, current = in_child(replays_as_the_trace_says)
    assert (allocs, live) == (3, 2)
    assert live_bytes >= 5 * MiB + 1000
    assert (total, current) == (6, 0)


def refuses(kind):
    h = Host(capacity=64 * MiB, route="vmm")
    t = Trace("bad")
    if kind == "stream":
        t.alloc(0, MiB, 3)  # only one stream handle given
    else:
        t.alloc(0, MiB, 0)
        t.alloc(1, 256 * MiB, 0)  # over the card
    replay = h.replayer(t, [h.stream()])
    try:
        replay()
    except Exception as e:  # noqa: BLE001 - the kind and message are what is checked
        live = h.allocated()
        replay.free_all()
        return type(e).__name__, str(e), live, h.allocated()
    return None


def test_a_stream_out_of_range_is_refused_naming_the_trace():
    name, msg, live, after = in_child(refuses, "stream")
    assert name == "ValueError" and "bad" in msg and "out of range" in msg
    assert (live, after) == (0, 0)


def test_an_allocation_the_card_cannot_hold_raises_the_cores_error_and_keeps_what_was_done():
    name, msg, live, after = in_child(refuses, "oom")
    assert name == "OutOfMemoryError", (name, msg)
    assert live >= MiB and after == 0  # the first allocation stood until free_all
