"""The demo's last step with --sleep: one sleep/wake cycle of the served model.

It serves a fixed prompt set and records the greedy tokens, releases the memory behind the
weights (backed up to the pinned host pool), the KV pool and the decode graphs (no backup),
restores it at the same addresses, serves the same prompts again through the same captured
graphs, and fails the demo when a token differs. The KV pool comes back undefined, so it is
reset before serving (`PagedKVCache.reset`); graph memory holds nothing between replays that a
replay does not write first (static inputs are copied in from pinned shadows, padding included).
"""

from __future__ import annotations

import contextlib
import dataclasses

from torch_budget.demo.requests import make_requests, run_requests
from torch_budget.demo.settings import TAG_GRAPHS, TAG_KV, TAG_WEIGHTS, DemoError, Settings
from torch_budget.units import format_bytes as _fmt

PROMPTS = 8  # the fixed prompt set: the first requests of the demo's stream


class _NoWatch:
    def sample(self) -> None:
        pass


def skip_reason(mode: str, device) -> str | None:
    """Why this run cannot release tagged memory, or None when it can."""
    if mode != "torch_budget":
        return ("torch_budget is not installed in this run (--native, or CUDA started before the demo); only its "
                "allocator can release tagged memory")
    import torch_budget

    if not torch_budget.diagnostics.capabilities(device.index)["vmm"]:
        return ("this device has no virtual memory management (VMM), which releasing memory while keeping its "
                "addresses needs")
    routes = [name for name, r in torch_budget.stats(device)["by_route"].items() if r["allocated"]]
    if "vmm" not in routes:
        return (f"the served model lives on the {' and '.join(routes) or 'no'} route (TORCH_BUDGET_CONF asks for "
                "it); only memory on the VMM route can be released")
    return None


def serve_prompts(torch, settings: Settings, model, cache, runner, meta, device, region) -> list:
    """The greedy tokens of the fixed prompt set, served as the demo serves (eager prefill,
    replayed decode graphs) from a reset KV pool, so that two calls place every block alike."""
    cache.reset()
    requests = make_requests(dataclasses.replace(settings, requests=min(PROMPTS, settings.requests)),
                             model.cfg.vocab)
    run_requests(torch, settings, model, cache, runner, meta, requests, _NoWatch(), device, region)
    return [req.out for req in requests]


def _first_difference(before: list, after: list) -> str:
    # One prompt set, so a request asks for as many tokens both times.
    j = next(k for k, (a, b) in enumerate(zip(before, after)) if a != b)
    return f"at token {j}: {before[j]} before, {after[j]} after"


def check_same_tokens(before: list, after: list) -> str:
    """A one-line verdict when every request got the same tokens; DemoError naming the first
    difference otherwise."""
    if len(before) != len(after):
        raise DemoError(f"sleep/wake changed what was served: {len(before)} requests before, {len(after)} after")
    differ = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    if differ:
        i = differ[0]
        raise DemoError(f"sleep/wake changed the served tokens: {len(differ)} of {len(before)} requests differ "
                        f"(request {i} first {_first_difference(before[i], after[i])}); the restored weights, KV "
                        "pool or graphs do not hold what they held")
    return f"served tokens identical before and after: {len(before)} requests, {sum(map(len, before))} tokens"


def _moved(report: dict, backup: str) -> str:
    """Bytes and time; the copy rate too where contents were copied (a backup other than none)."""
    seconds = report["seconds"]
    text = f"{_fmt(report['bytes']):>11} in {1e3 * seconds:7.1f} ms"
    if backup != "none" and seconds > 0:
        text += f" ({report['bytes'] / seconds / 1e9:.1f} GB/s)"
    return text


def _release(tb_sleep, tags: list, device) -> list:
    """Release each (tag, backup) in turn; when one fails, restore those released and raise."""
    done = []
    for tag, backup in tags:
        try:
            done.append(tb_sleep.release(tag, backup=backup, device=device))
        except (RuntimeError, ValueError) as e:
            for report in reversed(done):
                with contextlib.suppress(RuntimeError, ValueError):
                    tb_sleep.restore(report["tags"], device=device)
            raise DemoError(f"releasing tag {tag!r} (backup {backup}) failed: {e}") from None
    return done


def _restore(tb_sleep, tags: list, device) -> list:
    """Restore each tag in turn; a failure leaves it and the tags after it released, and raises."""
    done = []
    for i, (tag, _) in enumerate(tags):
        try:
            done.append(tb_sleep.restore(tag, device=device))
        except (RuntimeError, ValueError) as e:
            left = ", ".join(repr(t) for t, _ in tags[i:])
            raise DemoError(f"restoring tag {tag!r} failed ({e}); {left} stay released") from None
    return done


def sleep_wake(torch, settings: Settings, mode: str, *, model, cache, runner, meta, device, region) -> None:
    """The step itself; prints why it is skipped where tagged memory cannot be released."""
    reason = skip_reason(mode, device)
    if reason:
        print(f"  skipped: {reason}")
        return
    from torch_budget import sleep as tb_sleep

    before = serve_prompts(torch, settings, model, cache, runner, meta, device, region)
    states = tb_sleep.tag_states(device)
    tags = [(TAG_WEIGHTS, "pinned"), (TAG_KV, "none")]
    if runner.captured and TAG_GRAPHS in states:
        tags.append((TAG_GRAPHS, "none"))  # graph pools and static buffers: every replay rewrites them
    pool = tb_sleep.reserve_host_pool(states[TAG_WEIGHTS]["resident"])
    print(f"  {len(before)} prompts served, tokens recorded; pinned host pool {_fmt(pool)} for the weights' backup")

    free_awake = int(torch.cuda.mem_get_info(device)[0])
    released = _release(tb_sleep, tags, device)
    free_asleep = int(torch.cuda.mem_get_info(device)[0])
    for (tag, backup), report in zip(tags, released):
        print(f"  released {tag:<8} {_moved(report, backup)}, backup {backup}")
    print(f"  device free {_fmt(free_awake)} -> {_fmt(free_asleep)} while asleep "
          f"({_fmt(free_asleep - free_awake)} given back to the driver)")
    late = tb_sleep.host_pool_stats()["pinned_at_release"]
    if late:
        print(f"  {_fmt(late)} had to be pinned during the release: the host pool was smaller than the backup")

    restored = _restore(tb_sleep, tags, device)
    for (tag, backup), report in zip(tags, restored):
        what = "contents copied back" if backup != "none" else "contents undefined"
        print(f"  restored {tag:<8} {_moved(report, backup)}, {what}")
    print(f"  device free {_fmt(int(torch.cuda.mem_get_info(device)[0]))} after restore")
    tb_sleep.free_host_pool()

    after = serve_prompts(torch, settings, model, cache, runner, meta, device, region)
    print(f"  {check_same_tokens(before, after)} (KV pool reset, decode graphs replayed without re-capture)")
