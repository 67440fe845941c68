"""`torch-budget demo`: serve the built-in model inside a planned budget, then hold the plan
against what the card really did.

The demo is the whole story of the package in one run, in the order a serving engine must follow:
install the allocator before anything touches CUDA, load the weights, profile one worst-case
prefill, measure what the decode graphs will hold, plan the KV budget from those measurements,
allocate the KV pool from the plan, capture the decode graphs, serve a stream of mixed requests,
and finally print the plan's predicted peak next to the measured one and draw the measured
ledger. Every figure it prints is measured on the device or computed from measurements; the one
exception, the no-GPU path, plans on an assumed card and says so.

Workarounds for what other modules do not offer (kept here so their files stay as they are):
- `model.prefill` attends through torch's SDPA with freshly allocated GQA-expanded K/V and
  returns logits for every position. `prefill_last` below is the same computation with the
  expanded K/V placed in the eager workspace (so `torch_budget.workspace` manages the attention
  scratch) and logits for the last position only (serving samples nothing else). It reuses the
  model module's private helpers so the arithmetic cannot drift; a CPU test holds it equal to
  `model.prefill`.
- `model.decode` runs cache rows 0..B-1 and `PagedKVCache` cannot move a row's blocks, so the
  scheduler keeps finished rows as holes (their tables point at the null block) and a step
  covers rows up to the highest live one; holes and bucket padding write only the null block.
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch_budget.budget import positive_int

MiB = 1 << 20
GiB = 1 << 30

# The card the no-GPU path plans for. An assumption, printed as one wherever it is used.
ASSUMED_CARD = "NVIDIA H200"
ASSUMED_CARD_GIB = 139.8  # nominally 141 GB; the usable figure is itself assumed

TAG_WEIGHTS, TAG_KV, TAG_GRAPHS, TAG_ACTIVATIONS = "weights", "kv", "graphs", "activations"
FRACTION = 0.9  # the planner's default share of what the peak leaves free
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Settings:
    """What one demo run serves. `--quick` shrinks every dimension so a run takes seconds."""

    requests: int
    seed: int
    out: Path
    native: bool
    min_prompt: int
    max_prompt: int
    min_new: int
    max_new: int
    buckets: tuple
    kv_cap_bytes: int  # cap on the KV pool: the demo needs a few GiB, not the whole card

    @property
    def max_batch(self) -> int:
        # Every decode step replays a graph: concurrency is capped at the largest bucket.
        return self.buckets[-1]


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torch-budget demo",
        description="Serve the built-in model (random weights, nothing downloaded) inside a budget "
                    "planned from measurements, then compare the plan's predicted peak with the "
                    "measured one and draw the ledger. Without a CUDA device (or without the compiled "
                    "extension) it prints the plan for an assumed card and says why it stops there.",
    )
    p.add_argument("--requests", type=positive_int, help="requests to serve (default 48, 16 with --quick)")
    p.add_argument("--seed", type=_seed, default=0, help="seed for weights, prompt lengths and tokens")
    p.add_argument("--out", type=Path, default=Path("torch_budget_ledger.png"),
                   help="where to write the measured ledger picture (default: ./torch_budget_ledger.png)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests, fewer graphs, a smaller KV cap")
    p.add_argument("--native", action="store_true",
                   help="serve on torch's own allocator instead of installing torch_budget's (for comparison)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.quick:
        shape = dict(min_prompt=16, max_prompt=256, min_new=8, max_new=32, buckets=(1, 2, 4, 8), kv_cap_bytes=1 * GiB)
        requests = 16
    else:
        shape = dict(min_prompt=16, max_prompt=1024, min_new=16, max_new=64, buckets=(1, 2, 4, 8, 16, 32),
                     kv_cap_bytes=4 * GiB)
        requests = 48
    return Settings(requests=args.requests or requests, seed=args.seed, out=args.out, native=args.native, **shape)


# --- entry point ----------------------------------------------------------------------------------


class _CannotServe(Exception):
    """The serving run cannot start here; the message says exactly why."""


class DemoError(Exception):
    """The serving run was set up in a way that cannot work; the message says how to fix it."""


def main(argv=None) -> int:
    """`torch-budget demo [--requests N] [--seed S] [--out PATH] [--quick] [--native]`.

    Returns 0 on success (including the plan-only run without a GPU), 2 on bad options, 1 when
    serving failed (an OOM means the plan was wrong, which the message says).
    """
    parser = _parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    settings = settings_from_args(args)

    import torch

    try:
        mode = _start_allocator(torch, settings)
    except _CannotServe as e:
        return _plan_only(settings, str(e))
    except DemoError as e:
        print(f"torch-budget demo: error: {e}", file=sys.stderr)
        return 1
    try:
        _serve(torch, settings, mode)
    except torch.cuda.OutOfMemoryError as e:
        print(f"\ntorch-budget demo: OUT OF MEMORY while serving inside the plan; the plan under-estimated "
              f"something and the message says what was asked for:\n{e}", file=sys.stderr)
        return 1
    except DemoError as e:
        print(f"torch-budget demo: error: {e}", file=sys.stderr)
        return 1
    return 0


def _start_allocator(torch, settings: Settings) -> str:
    """Install torch_budget's allocator before anything touches CUDA; returns "torch_budget" or
    "native". Raises _CannotServe when there is no device or no usable extension.

    Only calls that do not initialise CUDA run before install(): `is_available` asks the driver
    for a device count, `is_initialized` reads a flag.
    """
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else " (this torch is a CPU-only build)"
        raise _CannotServe(f"no CUDA device visible: torch.cuda.is_available() is False{build}")
    if settings.native:
        print("allocator: torch's native caching allocator (--native); torch_budget's ledger is not used")
        return "native"
    from torch_budget import _native

    if not _native.is_built("_C"):
        raise _CannotServe(
            "the compiled extension torch_budget._C is not built: run `pip install --no-build-isolation -e .` "
            "in the repository (or rerun with --native to serve on torch's own allocator)")
    import torch_budget

    if torch_budget.installed():
        print("allocator: torch_budget was already installed by this process; the demo uses it as it is")
        return "torch_budget"
    if torch.cuda.is_initialized():
        print("allocator: CUDA was already initialised in this process before the demo started, so "
              "torch_budget.install() can no longer replace torch's allocator; falling back to torch's "
              "native allocator (run `torch-budget demo` in a fresh process to see torch_budget's ledger)")
        return "native"
    try:
        settings_in_force = torch_budget.install()
    except (ImportError, OSError) as e:
        # Typically an extension built against another torch: it exists but cannot be loaded.
        raise _CannotServe(
            f"the compiled extension torch_budget._C cannot be loaded ({e}); rebuild it against this torch "
            "with `pip install --no-build-isolation -e .` (or rerun with --native)") from None
    except (RuntimeError, ValueError) as e:
        # A bad TORCH_BUDGET_CONF (ValueError) or a refusal by the driver or the shim.
        raise DemoError(f"torch_budget.install() failed: {e} (rerun with --native to serve on torch's own "
                        "allocator)") from None
    budget = settings_in_force["budget_bytes"] or settings_in_force["budget_fraction"]
    print(f"allocator: torch_budget installed before the first CUDA tensor; route {settings_in_force['route']}, "
          f"budget {'the whole card' if budget is None else budget}")
    return "torch_budget"


def _plan_only(settings: Settings, reason: str) -> int:
    """Print the plan for the built-in model without serving, then the reason serving stops.

    With a device visible the plan uses the card's real size; otherwise it plans an assumed H200.
    """
    import torch

    from torch_budget.budget import cli_plan

    argv = ["--max-batch", "1", "--max-num-tokens", str(settings.max_prompt),
            "--max-kv-gib", f"{settings.kv_cap_bytes / GiB:g}"]
    if torch.cuda.is_available():
        print("Planning the built-in model for the visible card (size read from the device); weights are "
              "computed from the model's shape, activations estimated from shapes, memory outside torch "
              "and CUDA-graph pools not measured.")
    else:
        argv += ["--gpu-mem-gib", f"{ASSUMED_CARD_GIB:g}"]
        print(f"ASSUMPTION: no device to measure, so this plans the built-in model for an assumed card, "
              f"an {ASSUMED_CARD} taken as {ASSUMED_CARD_GIB:g} GiB usable (nominally 141 GB). Nothing "
              "below is measured: weights are computed from the model's shape, activations estimated from "
              "shapes, memory outside torch taken as 0, CUDA-graph pools left out.")
    print(f"Prefill runs one request at a time, so activations are estimated for one prompt of "
          f"{settings.max_prompt} tokens; the KV pool is capped at {settings.kv_cap_bytes / GiB:g} GiB as the "
          "serving run would cap it.\n")
    rc = cli_plan(argv)
    if rc != 0:
        return rc
    print(f"\ntorch-budget demo stops here: {reason}.")
    return 0


# --- the model's prefill with its attention scratch in the eager workspace --------------------------


def workspace_bytes(cfg, batch: int, length: int) -> int:
    """Bytes one layer of `prefill_last` asks the workspace for: GQA-expanded K and V."""
    return 2 * batch * length * cfg.heads * cfg.head_dim * cfg.itemsize


def prefill_last(model, token_ids, cache, rows, meta):
    """`model.prefill` with the attention scratch in the eager workspace; returns the logits of the
    last position only ([B, vocab]).

    Each layer asks `meta.get` for its GQA-expanded K and V; the one workspace grows to the largest
    layer's need (not the sum), and the `workspace(meta)` context (torch_budget.workspace) around
    the call lets it shrink again after short requests. Call it inside that context.
    """
    import torch
    import torch.nn.functional as F

    from torch_budget import model as m

    cfg = model.cfg
    batch, length = m.prefill_shape(cfg, token_ids)
    rows = list(rows)
    if len(rows) != batch:
        raise ValueError(f"rows must have one entry per sequence ({batch}), got {len(rows)}")
    device = token_ids.device
    with torch.no_grad():
        for row in rows:
            cache.release(row)
            cache.reserve(row, length)
        rows_t = torch.tensor(rows, device=device)
        positions = torch.arange(length, device=device)
        slots = cache.slots(rows_t[:, None], positions[None, :]).reshape(-1)
        cos, sin = model.rope_cos[:length], model.rope_sin[:length]
        group = cfg.heads // cfg.kv_heads
        expanded = batch * length * cfg.heads * cfg.head_dim
        x = F.embedding(token_ids, model.embed)
        for i, layer in enumerate(model.layers):
            h = m._rms_norm(x, layer.attn_norm)
            q = m._rotate(F.linear(h, layer.wq).view(batch, length, cfg.heads, cfg.head_dim), cos, sin)
            k = m._rotate(F.linear(h, layer.wk).view(batch, length, cfg.kv_heads, cfg.head_dim), cos, sin)
            v = F.linear(h, layer.wv).view(batch, length, cfg.kv_heads, cfg.head_dim)
            cache.k[i].index_copy_(0, slots, k.reshape(-1, cfg.kv_heads, cfg.head_dim))
            cache.v[i].index_copy_(0, slots, v.reshape(-1, cfg.kv_heads, cfg.head_dim))
            scratch = meta.get(workspace_bytes(cfg, batch, length)).view(cfg.torch_dtype)
            # Head h = kv * group + g, the order repeat_interleave(group, dim=2) gives in model.prefill.
            k_all = scratch[:expanded].view(batch, length, cfg.kv_heads, group, cfg.head_dim)
            v_all = scratch[expanded:].view(batch, length, cfg.kv_heads, group, cfg.head_dim)
            k_all.copy_(k.unsqueeze(3).expand(-1, -1, -1, group, -1))
            v_all.copy_(v.unsqueeze(3).expand(-1, -1, -1, group, -1))
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_all.view(batch, length, cfg.heads, cfg.head_dim).transpose(1, 2),
                v_all.view(batch, length, cfg.heads, cfg.head_dim).transpose(1, 2),
                is_causal=True,
            )
            x = x + F.linear(attn.transpose(1, 2).reshape(batch, length, -1), layer.wo)
            x = model._mlp(layer, x)
        return model._logits(x[:, -1])


# --- measuring -------------------------------------------------------------------------------------


@dataclass
class _Reading:
    """One look at the device: torch's allocated/reserved bytes, device-wide used, graph pools."""

    allocated: int
    reserved: int
    used: int
    pools: int


def _graph_pool_bytes(torch, device, mode: str) -> int:
    """Bytes held by CUDA-graph private pools on `device`.

    torch_budget's ledger counts them directly. torch's native allocator does not, but its
    snapshot tags each segment with the pool it belongs to: (0, 0) is the ordinary pool.
    """
    import torch_budget

    if mode == "torch_budget":
        return int(torch_budget.stats(device)["graph_pools"])
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index) != device.index:
            continue
        pool = seg.get("segment_pool_id")
        if pool is None:
            raise RuntimeError("torch.cuda.memory_snapshot() segments lack 'segment_pool_id' in this torch; "
                               "graph pool bytes cannot be measured on the native allocator (drop --native)")
        if tuple(pool) != (0, 0):
            total += int(seg["total_size"])
    return total


def _read(torch, device, mode: str) -> _Reading:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return _Reading(allocated=int(torch.cuda.memory_allocated(device)),
                    reserved=int(torch.cuda.memory_reserved(device)),
                    used=int(total - free), pools=_graph_pool_bytes(torch, device, mode))


class _DeviceWatch:
    """The largest device-wide used bytes seen during serving, with torch's reserved bytes at
    that moment (their difference is memory outside torch). Sampled between steps, without
    synchronising: cudaMemGetInfo is a driver query. Other processes on the card count too."""

    def __init__(self, torch, device):
        self._torch = torch
        self._device = device
        self.samples = 0
        self.peak_used = 0
        self.reserved_at_peak = 0

    def sample(self) -> None:
        free, total = self._torch.cuda.mem_get_info(self._device)
        self.samples += 1
        used = int(total - free)
        if used > self.peak_used:
            self.peak_used = used
            self.reserved_at_peak = int(self._torch.cuda.memory_reserved(self._device))


class _Progress:
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


# --- requests and scheduling -------------------------------------------------------------------------


@dataclass
class _Request:
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
        requests.append(_Request(i, prompt, rng.randint(settings.min_new, settings.max_new)))
    return requests


def _decode_runner(manager, name, model, cache, buckets):
    """A graph runner whose one captured piece is a greedy decode step over cache rows 0..bucket-1.

    Token ids and positions are host inputs: their copy to the device is captured in the graph,
    so a step is one memcpy into pinned shadows plus one replay. Padded rows feed token 0 at
    position 0 into rows whose block table points at the null block.
    """
    import torch

    from torch_budget.graphs import StaticInput
    from torch_budget.model import decode

    def decode_step(buffers):
        return {"next": decode(model, buffers["ids"], buffers["pos"], cache).argmax(dim=-1)}

    return manager.runner(name, decode_step, buckets=list(buckets),
                          inputs=[StaticInput("ids", torch.int64), StaticInput("pos", torch.int64)])


# --- the serving run ----------------------------------------------------------------------------------


def _fmt(n: int) -> str:
    from torch_budget.report import format_bytes

    return format_bytes(n)


def _step(i: int, text: str) -> None:
    print(f"\n[{i}/9] {text}")


def _serve(torch, settings: Settings, mode: str) -> None:
    import torch_budget
    from torch_budget import budget, report
    from torch_budget.graphs import GraphPoolManager
    from torch_budget.model import DemoModel, ModelConfig, PagedKVCache, kv_cache_cost, parameter_count
    from torch_budget.eager_workspace import WorkspaceMetadata, workspace as workspace_scope

    route = torch_budget.route
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = ModelConfig()
    if settings.max_prompt + settings.max_new > cfg.max_seq_len:
        raise DemoError(f"prompts of up to {settings.max_prompt} tokens plus {settings.max_new} new tokens exceed "
                         f"the model's max_seq_len={cfg.max_seq_len}")
    total = int(torch.cuda.mem_get_info(device)[1])
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}, {_fmt(total)} (measured); model: built-in, {parameter_count(cfg) / 1e6:.1f} M parameters, "
          f"{cfg.layers} layers, {cfg.dtype}, random weights")

    # 1. Weights, charged to their own tag.
    _step(1, "weights")
    before = _read(torch, device, mode)
    with route(tag=TAG_WEIGHTS):
        model = DemoModel(cfg, device=device, seed=settings.seed)
    weights = _read(torch, device, mode).allocated - before.allocated
    print(f"  {_fmt(weights)} allocated for parameters and buffers")

    # 2. The eager workspace: its warm-up size is the floor it never shrinks below.
    _step(2, "eager workspace")
    meta = WorkspaceMetadata(device, reclaimable=True)  # pure attention scratch: safe to reallocate
    meta.warm_up(workspace_bytes(cfg, 1, settings.min_prompt))
    print(f"  floor {_fmt(meta.floor)} (one {settings.min_prompt}-token prompt); grows to the largest layer's need")

    # 3. Profile one worst-case prefill. The KV it writes exists only for the estimate and is
    # handed back to the KV budget by the planner (estimation_kv_bytes).
    _step(3, f"profiling a dummy prefill of {settings.max_prompt} tokens")
    estimation = {}
    gen = torch.Generator().manual_seed(settings.seed + 1)

    def dummy_prefill():
        with route(tag=TAG_KV):
            est_cache = PagedKVCache(cfg, num_blocks=-(-settings.max_prompt // BLOCK_SIZE) + 1, max_batch=1,
                                     block_size=BLOCK_SIZE, device=device)
        estimation["kv"] = est_cache.nbytes + est_cache.block_tables.nbytes
        with route(tag=TAG_ACTIVATIONS):
            ids = torch.randint(0, cfg.vocab, (1, settings.max_prompt), generator=gen).to(device)
            with workspace_scope(meta):
                return prefill_last(model, ids, est_cache, [0], meta)

    prof = budget.profile(dummy_prefill, model_bytes=weights, device=device)
    ws_in_peak = meta.capacity
    print(f"  torch peak {_fmt(prof.torch_peak)}, activations {_fmt(prof.activation_bytes)} (incl. estimation KV "
          f"{_fmt(estimation['kv'])} and workspace {_fmt(ws_in_peak)}), outside torch {_fmt(prof.extra_cost)}")

    # 4. What the decode graphs will hold, measured by capturing them once against a 2-block cache:
    # a decode step's shapes depend on the batch and max_seq_len, not on how many blocks the cache has.
    _step(4, f"measuring the decode graphs (buckets {settings.buckets}) with a throw-away cache")
    manager = GraphPoolManager(device)  # one manager, so the real capture reuses the probe's capture stream
    start = _read(torch, device, mode)
    with route(tag=TAG_KV):
        probe_cache = PagedKVCache(cfg, num_blocks=2, max_batch=settings.max_batch, block_size=BLOCK_SIZE,
                                   device=device)
    before = _read(torch, device, mode)
    with route(tag=TAG_GRAPHS):
        probe = _decode_runner(manager, "decode-probe", model, probe_cache, settings.buckets)
        t0 = time.perf_counter()
        probe.capture()
        probe_seconds = time.perf_counter() - t0
    after = _read(torch, device, mode)
    graph_pools = after.pools - before.pools
    # Static buffers, plus what capture creates once per stream (e.g. cuBLAS's workspace for the
    # capture stream): allocated outside the pool and kept.
    graph_static = after.allocated - before.allocated
    # Executable graphs live outside torch: device-wide growth that torch did not reserve.
    graph_exec = max((after.used - before.used) - (after.reserved - before.reserved), 0)
    probe.close()
    del probe, probe_cache
    gc.collect()
    torch.cuda.empty_cache()
    # What outlives the probe (per-stream state such as cuBLAS's workspace for the capture stream)
    # is also what the real capture will not allocate again.
    probe_left = max(_read(torch, device, mode).allocated - start.allocated, 0)
    print(f"  captured {len(settings.buckets)} graphs in {probe_seconds:.2f} s: pool {_fmt(graph_pools)}, static "
          f"buffers {_fmt(graph_static)}, outside torch {_fmt(graph_exec)}; released again, "
          f"{_fmt(probe_left)} of capture-stream state stays")

    # 5. Plan.
    _step(5, "planning the KV budget")
    from_kv = [r for r in (
        budget.Reserve("decode graph pools", graph_pools,
                       f"measured: capture of {len(settings.buckets)} decode buckets", category="graph_pools"),
        budget.Reserve("decode static buffers", graph_static,
                       "measured: graph inputs/outputs and capture-stream state", category="graph_workspace"),
        budget.Reserve("decode graph execs", graph_exec,
                       "measured: device memory the captured graphs hold outside torch", category="non_torch"),
    ) if r.bytes > 0]
    plan = budget.plan(prof, kv_cache_cost(cfg), fraction=FRACTION, estimation_kv_bytes=estimation["kv"],
                       from_kv=from_kv, max_kv_bytes=settings.kv_cap_bytes, eager_workspace_in_peak=ws_in_peak,
                       title=f"plan: built-in model on {name} ({_fmt(total)})")
    print(plan.to_text())
    predicted = sum(line.bytes for line in plan.lines if line.category != "headroom")
    uncapped = next(s.kv_bytes for s in plan.steps if s.step == 5)
    print(f"\nKV pool capped at {_fmt(settings.kv_cap_bytes)} so the demo stays quick; uncapped, the plan would give "
          f"it {_fmt(uncapped)}")

    # 6. The KV pool, sized by the plan.
    _step(6, "allocating the KV pool from the plan")
    before = _read(torch, device, mode)
    try:
        with route(tag=TAG_KV):
            cache = PagedKVCache.from_budget(cfg, plan.kv_bytes, max_batch=settings.max_batch,
                                             block_size=BLOCK_SIZE, device=device)
    except ValueError as e:
        raise DemoError(f"the plan leaves too little for a KV pool: {e}") from None
    kv_bytes = _read(torch, device, mode).allocated - before.allocated
    print(f"  {cache.num_blocks} blocks of {BLOCK_SIZE} tokens ({cache.num_blocks * BLOCK_SIZE} tokens): "
          f"{_fmt(kv_bytes)} allocated, plan {_fmt(plan.kv_bytes)}")

    # 7. The decode graphs, captured for real against the KV pool (under install(), the shim
    # serves capture from its private pools).
    _step(7, "capturing the decode graphs")
    before = _read(torch, device, mode)
    with route(tag=TAG_GRAPHS):
        runner = _decode_runner(manager, "decode", model, cache, settings.buckets)
        runner.capture()
    after = _read(torch, device, mode)
    real_static = after.allocated - before.allocated
    print(f"  pool {_fmt(after.pools - before.pools)} (step 4 measured {_fmt(graph_pools)}), static buffers "
          f"{_fmt(real_static)} (+ {_fmt(probe_left)} capture-stream state kept from step 4)")

    # 8. Serve.
    requests = make_requests(settings, cfg.vocab)
    _step(8, f"serving {len(requests)} requests: prompts {min(r.prompt_len for r in requests)}-"
             f"{max(r.prompt_len for r in requests)} tokens, {settings.min_new}-{settings.max_new} new tokens, "
             f"at most {settings.max_batch} at once")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    watch = _DeviceWatch(torch, device)
    watch.sample()
    stats = _run_requests(torch, settings, model, cache, runner, meta, requests, watch, device, route)
    torch.cuda.synchronize(device)
    watch.sample()
    peak_allocated = int(torch.cuda.max_memory_allocated(device))
    peak_reserved = int(torch.cuda.max_memory_reserved(device))
    rate = stats["generated"] / stats["seconds"]
    step_ms = 1e3 * stats["step_seconds"] / max(stats["steps"], 1)
    print(f"  {stats['generated']} tokens generated in {stats['seconds']:.2f} s ({rate:.0f} tokens/s); "
          f"{stats['steps']} decode steps, mean {step_ms:.2f} ms, by bucket {dict(sorted(stats['buckets'].items()))}")
    print(f"  {stats['prefill_tokens']} prompt tokens prefilled; {len(stats['deferred'])} request(s) waited for KV "
          f"blocks; workspace {_fmt(meta.floor)}-{_fmt(stats['ws_peak'])}, shrank {stats['ws_shrinks']} time(s)")

    # 9. Plan against measurement, then the ledger.
    _step(9, "predicted against measured peak")
    predicted_torch = predicted - plan.bytes_in("non_torch")
    # Between replays a graph pool's blocks are reserved but not allocated.
    predicted_allocated = predicted_torch - plan.bytes_in("graph_pools")
    rows = [
        ("predicted peak: every plan line but headroom", predicted, None),
        (f"measured device-wide peak used (mem_get_info, {watch.samples} samples)", watch.peak_used, predicted),
        ("predicted torch share: plan minus non-torch lines", predicted_torch, None),
        ("measured torch peak reserved (max_memory_reserved)", peak_reserved, predicted_torch),
        ("predicted torch allocated: torch share minus graph pools", predicted_allocated, None),
        ("measured torch peak allocated (max_memory_allocated)", peak_allocated, predicted_allocated),
    ]
    width = max(len(r[0]) for r in rows)
    for label, value, against in rows:
        tail = f"  ratio {value / against:.3f}" if against else ""
        print(f"  {label:<{width}}  {_fmt(value):>11}{tail}")
    margin = plan.line("headroom").bytes
    over = watch.peak_used - predicted
    if over > 0:
        print(f"  the measured peak exceeds the prediction by {_fmt(over)}; the plan left {_fmt(margin)} unplanned, "
              f"{'which absorbs it' if over <= margin else 'which does NOT cover it'}")
    else:
        print(f"  the measured peak stayed {_fmt(-over)} below the prediction: no OOM with the KV pool the plan sized")

    lines = _measured_lines(torch, device, mode, total=total, weights=weights, kv=kv_bytes,
                            graph_static=probe_left + real_static, pools=_graph_pool_bytes(torch, device, mode),
                            ws_peak=stats["ws_peak"], peak_allocated=peak_allocated, watch=watch)
    title = f"measured during serving: built-in model on {name}" + (" (native allocator)" if mode == "native" else "")
    print()
    print(report.format_table(lines, total, title))
    _write_picture(report, lines, total, settings.out, title)
    manager.close()


def _run_requests(torch, settings, model, cache, runner, meta, requests, watch, device, route) -> dict:
    """Continuous batching: admit requests into free cache rows while KV blocks last (a request
    that does not fit waits for blocks; it is deferred, never failed), prefill each eagerly inside
    the workspace context, then run one replayed decode step over rows 0..highest live row.

    A request's blocks for prompt + new tokens are reserved at admission, so a decode step never
    runs out of KV mid-request.
    """
    from torch_budget.eager_workspace import workspace as workspace_scope

    queue = collections.deque(requests)
    active: list = [None] * settings.max_batch
    ids_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    pos_host = torch.zeros(settings.max_batch, dtype=torch.int64)
    stats = {"generated": 0, "steps": 0, "step_seconds": 0.0, "buckets": collections.Counter(), "deferred": set(),
             "prefill_tokens": 0, "ws_peak": meta.capacity, "ws_shrinks": 0}
    progress = _Progress(len(requests), "serving")
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
                with route(tag=TAG_ACTIVATIONS):
                    ids = req.prompt.to(device)[None]
                    with workspace_scope(meta):
                        logits = prefill_last(model, ids, cache, [row], meta)
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


def _measured_lines(torch, device, mode, *, total, weights, kv, graph_static, pools, ws_peak, peak_allocated, watch):
    """The ledger of the serving run.

    Resident lines (weights, KV, graph buffers and pools) are what they hold now; eager workspace
    and activations are their peaks during serving; non-torch is device-wide used minus torch's
    reserved bytes at the device-wide peak; what torch reserved beyond all torch lines then is the
    allocator's cache. With torch_budget installed every torch line comes from its per-tag ledger;
    on the native allocator they come from allocation deltas and the activations are derived.
    """
    import dataclasses

    import torch_budget
    from torch_budget import report

    if mode == "torch_budget":
        s = torch_budget.stats(device)
        tags = s["by_tag"]

        def tag(name, key="allocated"):
            return int(tags.get(name, {}).get(key, 0))

        weights, kv, graph_static = tag(TAG_WEIGHTS), tag(TAG_KV), tag(TAG_GRAPHS)
        pools = int(s["graph_pools"])
        from torch_budget.eager_workspace import WORKSPACE_TAG

        ws_peak = tag(WORKSPACE_TAG, "peak_allocated")
        activations = tag(TAG_ACTIVATIONS, "peak_allocated") + tag("untagged", "peak_allocated")
        why = {
            "weights": "torch_budget ledger, tag 'weights'",
            "kv_pool": "torch_budget ledger, tag 'kv'",
            "graph_workspace": "torch_budget ledger, tag 'graphs': static buffers, capture-stream state",
            "graph_pools": "torch_budget ledger: graph pool bytes",
            "eager_workspace": f"torch_budget ledger, tag '{WORKSPACE_TAG}': peak during serving",
            "activations": "torch_budget ledger, tags 'activations' + 'untagged': peak during serving",
        }
    else:
        activations = max(peak_allocated - weights - kv - graph_static - ws_peak, 0)
        why = {
            "weights": "allocation delta while loading",
            "kv_pool": "allocation delta of the KV pool",
            "graph_workspace": "allocation deltas of both captures: static buffers, capture-stream state",
            "graph_pools": "private-pool segments in torch.cuda.memory_snapshot()",
            "eager_workspace": "largest workspace capacity seen while serving",
            "activations": "derived: max_memory_allocated minus the other torch lines",
        }
    non_torch = max(watch.peak_used - watch.reserved_at_peak, 0)
    torch_lines = weights + kv + graph_static + pools + ws_peak + activations
    cache = max(watch.reserved_at_peak - torch_lines, 0)
    why["non_torch"] = "device-wide used minus torch reserved, at the device-wide peak"
    why["reserve"] = "allocator cache: torch reserved at the peak beyond every torch line above"
    lines = report.measured_ledger(total, weights=weights, kv_pool=kv, activations=activations,
                                   eager_workspace=ws_peak, graph_workspace=graph_static, graph_pools=pools,
                                   non_torch=non_torch, reserves=cache, source="measured")
    names = {"reserve": "allocator cache"}
    return [dataclasses.replace(line, name=names.get(line.category, line.name),
                                reason=why.get(line.category, line.reason)) for line in lines]


def _write_picture(report, lines, total, out: Path, title: str) -> None:
    """Draw the ledger; without matplotlib, keep it as JSON that `torch-budget report` renders."""
    import json

    try:
        path = report.write_png(lines, total, out, title)
    except OSError as e:
        raise DemoError(f"cannot write the ledger picture to {out}: {e}") from None
    except ImportError as e:
        saved = out.with_suffix(".json")
        try:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"title": title, "total": total, "lines": [l.to_dict() for l in lines]},
                                        indent=2))
        except OSError as err:
            raise DemoError(f"cannot write the ledger to {saved}: {err}") from None
        print(f"\npicture not drawn ({e}); the ledger is saved as {saved}: render it where matplotlib is "
              f"installed with `torch-budget report {saved}`")
        return
    print(f"\nledger picture written to {path}")
