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

    # The names the resource managers read (torch_budget.resources.TokenRequest).
    @property
    def request_id(self) -> int:
        return self.index

    @property
    def max_new_tokens(self) -> int:
        return self.new_tokens


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


def resources(settings, model, cache, runner, meta, workspace_tokens: int | None = None) -> list:
    """The serving run's resource managers (Note [Resource managers]): the KV cache's blocks, the
    eager workspace's prompt tokens per step (`workspace_tokens`, else the longest prompt) and
    the decode graphs' rows."""
    from torch_budget.demo.kv_resource import PagedKVResource
    from torch_budget.demo.model import prefill_workspace_bytes
    from torch_budget.graphs.resource import GraphResource
    from torch_budget.workspace_resource import WorkspaceResource

    return [PagedKVResource(cache, longest_prompt=settings.max_prompt),
            WorkspaceResource(meta, prefill_workspace_bytes(model.cfg, 1, 1), workspace_tokens or settings.max_prompt),
            GraphResource(runner)]


def run_requests(torch, settings, model, cache, runner, meta, requests, watch, device, region, *,
                 workspace_tokens: int | None = None) -> dict:
    """Continuous batching over the resource managers (torch_budget.scheduling): each step admits
    waiting requests in order while the KV cache, the workspace and the decode rows all have
    room (a request that does not fit waits: it is deferred, never failed), prefills each
    admitted one eagerly inside the workspace context, then runs one replayed decode step over
    rows 0..highest live row.

    A request's blocks for prompt + new tokens are reserved at admission, so a decode step never
    runs out of KV mid-request.
    """
    from torch_budget.demo.model import prefill
    from torch_budget.eager_workspace import workspace as workspace_scope
    from torch_budget.errors import RequestTooLargeError
    from torch_budget.scheduling import Scheduler

    kv, ws, graphs = managers = resources(settings, model, cache, runner, meta, workspace_tokens)
    scheduler = Scheduler(managers)
    try:
        for req in requests:
            scheduler.submit(req)
    except RequestTooLargeError as e:
        raise DemoError(str(e)) from None
    ids_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    pos_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    stats = {"generated": 0, "steps": 0, "step_seconds": 0.0, "buckets": collections.Counter(),
             "deferred": scheduler.deferred, "waits": scheduler.waits, "prefill_tokens": 0, "ws_peak": meta.capacity,
             "ws_shrinks": 0}
    progress = Progress(len(requests), "serving")
    start = time.perf_counter()
    try:
        while not scheduler.idle:
            step = scheduler.schedule()
            done = []
            for req in step.context:
                capacity = meta.capacity
                with region(TAG_ACTIVATIONS):
                    ids = req.prompt.to(device)[None]
                    with workspace_scope(meta):
                        logits = prefill(model, ids, cache, [kv.row_of(req)], scratch=meta, last_only=True)
                    first = int(logits[0].argmax())
                if meta.capacity < capacity:
                    stats["ws_shrinks"] += 1
                stats["ws_peak"] = max(stats["ws_peak"], meta.capacity)
                stats["prefill_tokens"] += req.prompt_len
                req.out.append(first)
                req.next_pos = req.prompt_len
                watch.sample()
                if len(req.out) >= req.new_tokens:
                    done.append(req)
            finished = {r.request_id for r in done}
            live = {kv.row_of(r): r for r in step.generation if r.request_id not in finished}
            if live:
                n = max(live) + 1
                ids_host.zero_()
                pos_host.zero_()
                for row, req in live.items():
                    ids_host[row] = req.out[-1]
                    pos_host[row] = req.next_pos
                t0 = time.perf_counter()
                nxt = runner.step(n, ids=ids_host[:n], pos=pos_host[:n])["next"].cpu()
                stats["step_seconds"] += time.perf_counter() - t0
                stats["steps"] += 1
                stats["buckets"][runner.bucket_for(n)] += 1
                watch.sample()
                for row, req in live.items():
                    req.out.append(int(nxt[row]))
                    req.next_pos += 1
                    if len(req.out) >= req.new_tokens:
                        done.append(req)
            scheduler.complete(step)
            for req in done:
                scheduler.finish(req)
                stats["generated"] += len(req.out)
            if done:
                progress.update(len(done), live=len(scheduler.running), queued=len(scheduler.waiting))
    finally:
        progress.close()
    stats["seconds"] = time.perf_counter() - start
    return stats
