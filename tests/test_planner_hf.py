"""The planner on Hugging Face transformers decoders (torch_budget.planner.hf, hf_plan): the
shapes of the public models, their KV cost against transformers' own StaticCache, the cache's
rows as a resource manager, and the worst-case serving loop, on CPU with small configs; the whole
plan, enforced, on a device. Everything skips without transformers (the package imports without it)."""
import os
import subprocess
import sys

import pytest
import torch

from _harness import REPO, repo_env
from torch_budget.errors import RequestTooLargeError
from torch_budget.planner import hf
from torch_budget.scheduling import Scheduler
from torch_budget.resources import DummyRequest

transformers = pytest.importorskip("transformers")

# (parameters of the public checkpoint, head size) for each shape
PUBLIC = {"llama-3.2-1b": (1_235_814_400, 64), "llama-3.1-8b": (8_030_261_248, 128),
          "qwen2.5-1.5b": (1_543_714_304, 128), "qwen3-4b": (4_022_468_096, 128)}

SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)


def small(name="qwen3-4b", batch=3, prompt_len=6, max_len=16, new_tokens=4, **config):
    base = hf.MODELS[name]
    extra = {"head_dim": 64} if base.model_type == "qwen3" else {}
    return hf.HFModel(base.model_type, {**base.config, **SMALL, **extra, **config}, batch=batch, prompt_len=prompt_len,
                      max_len=max_len, new_tokens=new_tokens, shape_of=f"small {base.shape_of}")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_shape_has_its_public_models_parameters_and_gqa(name):
    config = hf.make_config(name)
    params, head = PUBLIC[name]
    model = hf.build(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == params
    assert hf.head_dim(config) == head
    assert config.num_attention_heads > config.num_key_value_heads, "grouped-query attention"
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert hf.weight_bytes(config) == 2 * params + buffers, "bf16, the tied head counted once"


def test_qwen3s_head_size_is_its_own_not_hidden_over_heads():
    config = hf.make_config("qwen3-4b")
    assert config.hidden_size // config.num_attention_heads == 80 and hf.head_dim(config) == 128
    assert hf.kv_cost(config).slope == 2 * 36 * 8 * 128 * 2


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_kv_cost_is_what_transformers_static_cache_allocates(name):
    config = hf.make_config(small(name))
    cache = hf.static_cache(config, batch=3, max_len=16, dtype="float32")
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == hf.kv_cost(config, "float32").slope * 3 * 16


def test_a_worst_case_that_does_not_fit_its_own_length_is_refused():
    with pytest.raises(ValueError, match="prompt_len"):
        small(prompt_len=14, max_len=16, new_tokens=4)


def test_the_serving_loop_decodes_what_a_full_forward_predicts():
    from torch_budget.planner import hf_plan

    loaded = hf_plan.load(small(), device="cpu", dtype="float32")
    assert loaded.weights == hf.weight_bytes(loaded.module)
    cache, nbytes = hf_plan.cache_for(loaded, 2, device="cpu", dtype="float32")
    assert nbytes == hf.kv_cost(loaded.config, "float32").slope * 2 * 16
    ids = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    seq = [ids, hf_plan.prefill(loaded, cache, ids)[:, None]]
    for position in range(6, 9):
        seq.append(hf_plan.decode(loaded, cache, seq[-1][:, 0], position)[:, None])
    seq = torch.cat(seq, 1)
    with torch.no_grad():
        full = loaded.module(input_ids=seq[:, :-1]).logits.argmax(-1)[:, 5:]
    assert torch.equal(seq[:, 6:], full)


def test_serving_the_worst_case_runs_every_request_and_empties_the_cache():
    from torch_budget.planner import hf_plan

    loaded = hf_plan.load(small(batch=3, new_tokens=4), device="cpu", dtype="float32")
    cache, _ = hf_plan.cache_for(loaded, 3, device="cpu", dtype="float32")
    served = hf_plan.serve(loaded, cache, 3, device="cpu")
    assert served == {"generated": 12, "decode_steps": 3}
    assert all(not layer.keys.any() for layer in cache.layers), "the last request's free reset the cache"


def rows(batch=2, max_len=16):
    cache = hf.static_cache(hf.make_config(small()), batch=batch, max_len=max_len, dtype="float32")
    return hf.StaticCacheResource(cache, batch=batch, max_len=max_len, prompt_len=6, new_tokens=4)


def test_static_cache_rows_move_in_lock_step_so_a_new_request_waits_for_the_batch():
    res = rows(batch=2)
    scheduler = Scheduler([res])
    for i in range(3):
        scheduler.submit(DummyRequest(i, 6, 4))
    first = scheduler.schedule()
    assert [r.request_id for r in first.context] == [0, 1] and scheduler.deferred == {2}
    scheduler.complete(first)
    scheduler.finish(first.context[0])
    assert res.free_tokens() == 0, "a row is free, but the other is mid-sequence"
    assert scheduler.schedule().context == ()
    scheduler.finish(first.context[1])
    assert [r.request_id for r in scheduler.schedule().context] == [2] and res.row_of(DummyRequest(2, 6, 4)) == 0


def test_a_request_longer_than_a_row_is_refused_and_the_dummies_are_the_worst_case():
    res = rows(batch=2, max_len=16)
    with pytest.raises(RequestTooLargeError, match="tokens of 'kv'"):
        Scheduler([res]).submit(DummyRequest(0, 12, 5))
    assert [(d.prompt_len, d.max_new_tokens) for d in res.dummy_requests()] == [(6, 4), (6, 4)]


def test_rows_within_counts_whole_rows_beside_the_caches_fixed_bytes():
    from torch_budget.planner import hf_plan

    loaded = hf_plan.load(small(batch=4, max_len=16), device="cpu", dtype="bfloat16")
    row = hf.kv_cost(loaded.config).slope * 16
    fixed = 2 * 512  # what a measured cache holds beside its rows (here: two per-layer counters)

    class Planned:
        kv_bytes = 3 * row + fixed + row - 1

    assert hf_plan.rows_within(Planned, loaded, 4 * row + fixed) == 3
    Planned.kv_bytes = 9 * row
    assert hf_plan.rows_within(Planned, loaded, 4 * row + fixed) == 4, "never more than the worst case's batch"


def test_the_script_without_a_device_says_so():
    env = repo_env({"CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan_hf.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "needs a CUDA device" in proc.stderr, proc.stderr


# --- on a device ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_planned_hf_model_serves_its_worst_case_and_one_sequence_more_is_refused_naming_kv(fresh):
    out = fresh(plan_apply_serve_and_push)
    refused, served_again, kv_budget, kv_used = out.value
    assert "tag 'kv' would exceed its budget" in refused, refused
    assert served_again == 2 * 8 and kv_used <= kv_budget


def plan_apply_serve_and_push():
    import gc

    import torch_budget
    from torch_budget.planner import hf_plan

    torch_budget.install()
    device = torch.device("cuda", 0)
    spec = hf.HFModel("llama", {**hf.MODELS["llama-3.2-1b"].config, **SMALL, "hidden_size": 256,
                                "num_attention_heads": 8, "vocab_size": 4096}, batch=2, prompt_len=64, max_len=256,
                      new_tokens=8, shape_of="small Llama-3.2-1B")
    loaded = hf_plan.load(spec, device=device)
    plan, cache_bytes = hf_plan.plan_loaded(loaded, device=device)
    plan.apply(device)
    n = hf_plan.rows_within(plan, loaded, cache_bytes)
    assert n == spec.batch, (n, plan.to_text())
    cache, _ = hf_plan.cache_for(loaded, n, device=device)
    hf_plan.serve(loaded, cache, n, device=device)
    refused = ""
    try:
        hf_plan.cache_for(loaded, 1, device=device)
    except torch.cuda.OutOfMemoryError as e:
        refused = str(e)
    gc.collect()
    again = hf_plan.serve(loaded, cache, n, device=device)
    kv = torch_budget.stats(device)["by_tag"]["kv"]
    return refused, again["generated"], kv["budget"], kv["allocated"]
