"""Profiling, planning and serving a Hugging Face decoder at its worst case (Note [Planning an
HF model] in planner/hf.py), in the order a serving engine follows: install, load the weights,
profile the worst step, plan, enforce the plan (Plan.apply), allocate the KV cache from it,
serve. Needs a CUDA device and transformers; tools/plan_hf.py runs each part in a fresh process.

Tags are the planner's (planner.TAGS): the weights under "weights", the StaticCache under "kv",
every forward under "activations".
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

from torch_budget.planner.apply import TAGS
from torch_budget.planner.hf import (MODELS, HFModel, StaticCacheResource, build, kv_cost, make_config, static_cache,
                                     weight_bytes)

TAG_WEIGHTS, TAG_KV, TAG_ACTIVATIONS = TAGS["weights"], TAGS["kv_pool"], TAGS["activations"]


@dataclass
class Loaded:
    """A model on the device: its spec, config, module and the bytes its weights took."""

    spec: HFModel
    config: object
    module: object
    weights: int


def _allocated(device) -> int | None:
    """torch's allocated bytes on a CUDA `device` (None elsewhere: nothing to read)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def load(name: str | HFModel, *, device, seed: int = 0, dtype: str = "bfloat16", **overrides) -> Loaded:
    """Build model `name` (a MODELS key, or an HFModel) on `device` under the weights tag, with
    config `overrides`. Its weight bytes are the allocation delta on a CUDA device (their count
    elsewhere)."""
    import torch_budget

    spec = MODELS[name] if isinstance(name, str) else name
    config = make_config(spec, **overrides)
    before = _allocated(device)
    with torch_budget.region(TAG_WEIGHTS):
        module = build(config, dtype=dtype, device=device, seed=seed)
    weights = weight_bytes(module) if before is None else _allocated(device) - before
    return Loaded(spec, config, module, weights)


def prefill(loaded: Loaded, cache, ids):
    """The next token of each of `ids` ([B, T] from position 0), their K and V written to `cache`."""
    import torch

    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch, -1)
    with torch.no_grad():
        out = loaded.module(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions,
                            logits_to_keep=1)
    return out.logits[:, -1].argmax(-1)


def decode(loaded: Loaded, cache, tokens, position: int):
    """One decode step: `tokens` [B] at `position` (every row in lock-step); the next tokens."""
    import torch

    positions = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
    with torch.no_grad():
        out = loaded.module(input_ids=tokens[:, None], past_key_values=cache, use_cache=True, position_ids=positions,
                            logits_to_keep=1)
    return out.logits[:, -1].argmax(-1)


def cache_for(loaded: Loaded, batch: int, *, device, dtype: str = "bfloat16"):
    """A StaticCache of `batch` rows of the model's max_len, under the KV tag; (cache, its bytes)."""
    import torch_budget

    before = _allocated(device)
    with torch_budget.region(TAG_KV):
        cache = static_cache(loaded.config, batch=batch, max_len=loaded.spec.max_len, dtype=dtype, device=device)
    if before is None:
        return cache, sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return cache, _allocated(device) - before


def resource(loaded: Loaded, cache, batch: int) -> StaticCacheResource:
    spec = loaded.spec
    return StaticCacheResource(cache, batch=batch, max_len=spec.max_len, prompt_len=spec.prompt_len,
                               new_tokens=spec.new_tokens, tag=TAG_KV)


def plan_loaded(loaded: Loaded, *, device, fraction: float = 0.9, seed: int = 0, dtype: str = "bfloat16"):
    """Profile the worst step (a prefill of `batch` prompts and one decode step, on a cache of the
    worst case's shape) and plan; the KV line is that cache's measured bytes (Note [Planning an
    HF model]). Returns the plan and the cache's bytes."""
    import torch

    import torch_budget
    from torch_budget import planner

    spec = loaded.spec
    cache, cache_bytes = cache_for(loaded, spec.batch, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)

    def worst_step(step):
        with torch_budget.region(TAG_ACTIVATIONS):
            ids = torch.randint(0, loaded.config.vocab_size, (len(step.context), spec.prompt_len), generator=gen)
            first = prefill(loaded, cache, ids.to(device))
            return decode(loaded, cache, first, spec.prompt_len)

    prof = planner.profile_step([resource(loaded, cache, spec.batch)], worst_step, model_bytes=loaded.weights,
                                device=device)
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    plan = planner.plan(prof, kv_cost(loaded.config, dtype), fraction=fraction, estimation_kv_bytes=cache_bytes,
                        max_kv_bytes=cache_bytes,
                        title=f"plan: {spec.shape_of} shape, random weights, {spec.batch} x {spec.max_len} tokens")
    return plan, cache_bytes


def rows_within(plan, loaded: Loaded, cache_bytes: int, dtype: str = "bfloat16") -> int:
    """How many of the worst case's rows the plan's KV line holds: the per-layer counters cost
    the same for any batch, each row max_len tokens at the KV slope."""
    spec = loaded.spec
    row = kv_cost(loaded.config, dtype).slope * spec.max_len
    fixed = cache_bytes - spec.batch * row
    return max(min(spec.batch, (plan.kv_bytes - fixed) // row), 0)


def predicted_peaks(plan, kv_bytes: int) -> tuple[int, int]:
    """The peak the plan predicts for serving its worst case on a KV cache of `kv_bytes` (the
    cache allocated from its KV line): torch's allocated bytes (its weights and activations lines
    and that cache) and the device's used bytes (those, its allocator cache and its non-torch
    lines)."""
    allocated = plan.bytes_in("weights") + plan.bytes_in("activations") + kv_bytes
    return allocated, allocated + plan.bytes_in("allocator_cache") + plan.bytes_in("non_torch")


def serve(loaded: Loaded, cache, batch: int, *, device, watch=None, seed: int = 0) -> dict:
    """Serve `batch` requests of the worst case through the scheduler (they join the cache
    together: its rows move in lock-step): prefill, then decode to `new_tokens` each. Returns
    tokens generated and steps."""
    import torch

    import torch_budget
    from torch_budget.resources import DummyRequest
    from torch_budget.scheduling import Scheduler

    spec = loaded.spec
    scheduler = Scheduler([resource(loaded, cache, batch)])
    for i in range(batch):
        scheduler.submit(DummyRequest(i, spec.prompt_len, spec.new_tokens))
    gen = torch.Generator().manual_seed(seed + 2)
    generated = steps = 0
    while not scheduler.idle:
        step = scheduler.schedule()
        with torch_budget.region(TAG_ACTIVATIONS):
            ids = torch.randint(0, loaded.config.vocab_size, (len(step.context), spec.prompt_len), generator=gen)
            tokens = prefill(loaded, cache, ids.to(device))
            for j in range(1, spec.new_tokens):
                if watch is not None:
                    watch.sample()
                tokens = decode(loaded, cache, tokens, spec.prompt_len + j - 1)
                steps += 1
        generated += len(step.context) * spec.new_tokens
        scheduler.complete(step)
        for req in step.generation:
            scheduler.finish(req)
    if watch is not None:
        watch.sample()
    return {"generated": generated, "decode_steps": steps}
