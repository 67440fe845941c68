"""The demo's request stream and its continuous-batching scheduler."""

from __future__ import annotations

import collections
import math
import random
import sys
import time
from dataclasses import dataclass, field

from torch_budget.demo.settings import TAG_ACTIVATIONS, DemoError, Settings


class Progress:
    """tqdm when it is installed, else a one-line text bar on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
            self._last = -1.0
            self._draw()
        else:
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
        elif time.monotonic() - self._last > 0.25 or self.done == self.total:
            self._draw(postfix)

    def _draw(self, postfix=None) -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        extra = "  " + ", ".join(f"{k}={v}" for k, v in postfix.items()) if postfix else ""
        sys.stderr.write(f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}{extra}")
        sys.stderr.flush()
        self._last = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass
class Request:
    index: int
    prompt: object  # int64 CPU tensor [prompt_len]
    new_tokens: int
    out: list = field(default_factory=list)
    next_pos: int = 0  # position of the token the next decode step feeds

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])


def make_requests(settings: Settings, vocab: int) -> list:
    """Prompt lengths log-uniform in [min_prompt, max_prompt] (short prompts dominate, as in real
    traffic, while long ones still appear); new-token counts uniform; random token ids."""
    import torch

    rng = random.Random(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    lo, hi = math.log(settings.min_prompt), math.log(settings.max_prompt)
    requests = []
    for i in range(settings.requests):
        length = min(max(int(round(math.exp(rng.uniform(lo, hi)))), settings.min_prompt), settings.max_prompt)
        prompt = torch.randint(0, vocab, (length,), generator=gen)
        requests.append(Request(i, prompt, rng.randint(settings.min_new, settings.max_new)))
    return requests


def run_requests(torch, settings, model, cache, runner, meta, requests, watch, device, region) -> dict:
    """Continuous batching: admit requests into free cache rows while KV blocks last (a request
    that does not fit waits for blocks; it is deferred, never failed), prefill each eagerly inside
    the workspace context, then run one replayed decode step over rows 0..highest live row.

    A request's blocks for prompt + new tokens are reserved at admission, so a decode step never
    runs out of KV mid-request.
    """
    from torch_budget.eager_workspace import workspace as workspace_scope
    from torch_budget.demo.model import prefill

    queue = collections.deque(requests)
    active: list = [None] * settings.max_batch
    ids_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    pos_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    stats = {"generated": 0, "steps": 0, "step_seconds": 0.0, "buckets": collections.Counter(), "deferred": set(),
             "prefill_tokens": 0, "ws_peak": meta.capacity, "ws_shrinks": 0}
    progress = Progress(len(requests), "serving")
    start = time.perf_counter()

    def finish(row, req):
        cache.release(row)
        active[row] = None
        stats["generated"] += len(req.out)
        progress.update(1, live=sum(r is not None for r in active), queued=len(queue))

    try:
        while queue or any(r is not None for r in active):
            while queue and None in active:
                req = queue[0]
                need = -(-(req.prompt_len + req.new_tokens) // cache.block_size)
                if need > cache.free_blocks:
                    if not any(r is not None for r in active):
                        raise DemoError(f"request {req.index} needs {need} KV blocks but the whole pool has "
                                         f"{cache.num_blocks - 1}; raise the KV budget")
                    stats["deferred"].add(req.index)
                    break
                queue.popleft()
                row = active.index(None)
                capacity = meta.capacity
                with region(TAG_ACTIVATIONS):
                    ids = req.prompt.to(device)[None]
                    with workspace_scope(meta):
                        logits = prefill(model, ids, cache, [row], scratch=meta, last_only=True)
                    first = int(logits[0].argmax())
                if meta.capacity < capacity:
                    stats["ws_shrinks"] += 1
                stats["ws_peak"] = max(stats["ws_peak"], meta.capacity)
                stats["prefill_tokens"] += req.prompt_len
                cache.reserve(row, req.prompt_len + req.new_tokens)
                req.out.append(first)
                req.next_pos = req.prompt_len
                active[row] = req
                watch.sample()
                if len(req.out) >= req.new_tokens:
                    finish(row, req)

            live = [row for row, r in enumerate(active) if r is not None]
            if not live:
                continue
            n = live[-1] + 1
            ids_host.zero_()
            pos_host.zero_()
            for row in live:
                ids_host[row] = active[row].out[-1]
                pos_host[row] = active[row].next_pos
            t0 = time.perf_counter()
            nxt = runner.step(n, ids=ids_host[:n], pos=pos_host[:n])["next"].cpu()
            stats["step_seconds"] += time.perf_counter() - t0
            stats["steps"] += 1
            stats["buckets"][runner.bucket_for(n)] += 1
            watch.sample()
            for row in live:
                req = active[row]
                req.out.append(int(nxt[row]))
                req.next_pos += 1
                if len(req.out) >= req.new_tokens:
                    finish(row, req)
    finally:
        progress.close()
    stats["seconds"] = time.perf_counter() - start
    return stats
