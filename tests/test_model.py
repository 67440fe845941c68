"""The demo's model and its paged KV cache (torch_budget.demo.model), on CPU unless marked."""
import dataclasses

import pytest
import torch

from conftest import MiB
from torch_budget.demo.model import DemoModel, PagedKVCache, decode, prefill
from torch_budget.demo.settings import MODEL
from torch_budget.planner.shape import ModelShape, kv_cache_cost, parameter_count, weight_bytes

TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256, vocab=97, head_dim=16, max_seq_len=40,
                  dtype="float32")


@pytest.fixture(scope="module")
def model():
    return DemoModel(TINY, seed=1)


def tokens(batch, length, seed=0):
    return torch.randint(0, TINY.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_planners_weight_bytes_match_the_demo_modules_parameters():
    cfg = ModelShape(layers=3, hidden=48, heads=6, kv_heads=3, intermediate=100, vocab=50, head_dim=8, max_seq_len=16,
                     dtype="bfloat16")
    module = DemoModel(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in module.parameters())
    assert weight_bytes(cfg) == sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_built_in_model_has_about_63_million_parameters():
    module = DemoModel(MODEL)
    assert sum(p.numel() for p in module.parameters()) == parameter_count(MODEL) == 63_185_408


def test_kv_cost_per_token_matches_the_cache_tensors():
    cost = kv_cache_cost(TINY)
    cache = PagedKVCache(TINY, num_blocks=5, max_batch=2, block_size=4)
    assert cost.slope == 2 * TINY.layers * TINY.kv_heads * TINY.head_dim * 4
    assert cache.nbytes == cost.bytes_for_tokens(5 * 4)
    assert cost.max_tokens_per_request == TINY.max_seq_len


def test_cache_from_budget_uses_tokens_for_budget_rounded_to_blocks():
    cost = dataclasses.replace(kv_cache_cost(TINY), tensors=2)  # the pool's K and V tensors
    budget = cost.charged_for_tokens(38)  # 38 tokens fit, as the allocator charges them; 39 do not
    assert cost.tokens_for_tag_budget(budget) == 38 and cost.charged_for_tokens(39) > budget
    tables = -(-PagedKVCache.table_bytes(TINY, 2, 8) // 512) * 512
    cache = PagedKVCache.from_budget(TINY, budget + tables, max_batch=2, block_size=8)
    assert cache.num_blocks == 38 // 8
    charged = sum(-(-t.nbytes // 512) * 512 for t in (cache.k, cache.v, cache.block_tables))
    assert charged <= budget + tables  # what the KV tag is charged: the pool fits its own budget


def test_cache_from_budget_leaves_room_for_its_block_tables():
    cost = kv_cache_cost(TINY)
    budget = cost.bytes_for_tokens(5 * 8)  # five blocks of 8 exactly: no room left for the tables
    cache = PagedKVCache.from_budget(TINY, budget, max_batch=2, block_size=8)
    assert cache.block_tables.nbytes == PagedKVCache.table_bytes(TINY, 2, 8) == 2 * 5 * 8
    assert cache.num_blocks == 4 and cache.nbytes + cache.block_tables.nbytes <= budget
    # the 80 bytes of tables are charged a whole 512-byte unit
    assert PagedKVCache.from_budget(TINY, budget + 511, max_batch=2, block_size=8).num_blocks == 4
    assert PagedKVCache.from_budget(TINY, budget + 512, max_batch=2, block_size=8).num_blocks == 5


def test_cache_from_too_small_budget_names_the_numbers():
    with pytest.raises(ValueError, match="raise the budget"):
        PagedKVCache.from_budget(TINY, 1 * MiB // 1024, max_batch=1, block_size=16)


def test_cache_reserve_past_capacity_raises_and_keeps_the_cache_intact():
    cache = PagedKVCache(TINY, num_blocks=3, max_batch=2, block_size=4)  # 2 usable blocks
    cache.reserve(0, 8)
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.reserve(1, 1)
    cache.release(0)
    assert cache.free_blocks == 2
    assert int(cache.block_tables.abs().sum()) == 0


def test_prefill_then_decode_matches_full_prefill(model):
    ids = tokens(2, 13)
    cache = PagedKVCache(TINY, num_blocks=16, max_batch=2, block_size=4)
    full = prefill(model, ids, cache)
    # Two sequences of different lengths, then one batched decode step at different positions.
    prefill(model, ids[0:1, :7], cache, rows=[0])
    prefill(model, ids[1:2, :11], cache, rows=[1])
    cache.reserve(0, 8)
    cache.reserve(1, 12)
    out = decode(model, torch.stack([ids[0, 7], ids[1, 11]]), torch.tensor([7, 11]), cache)
    torch.testing.assert_close(out[0], full[0, 7], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[1], full[1, 11], rtol=1e-4, atol=1e-5)


def test_consecutive_decode_steps_match_full_prefill(model):
    ids = tokens(1, 12, seed=3)
    cache = PagedKVCache(TINY, num_blocks=8, max_batch=1, block_size=4)
    full = prefill(model, ids, cache)
    prefill(model, ids[:, :5], cache)
    for pos in range(5, 12):
        cache.reserve(0, pos + 1)
        out = decode(model, ids[:, pos], torch.tensor([pos]), cache)
        torch.testing.assert_close(out[0], full[0, pos], rtol=1e-4, atol=1e-5)


def test_padded_decode_row_writes_to_the_null_block_not_a_live_sequence(model):
    ids = tokens(1, 9, seed=5)
    cache = PagedKVCache(TINY, num_blocks=8, max_batch=2, block_size=4)
    full = prefill(model, ids, cache)
    prefill(model, ids[:, :8], cache, rows=[0])
    cache.reserve(0, 9)
    # Row 1 owns no blocks (padding, as in a captured bucket larger than the live batch).
    out = decode(model, torch.stack([ids[0, 8], ids[0, 0]]), torch.tensor([8, 3]), cache)
    torch.testing.assert_close(out[0], full[0, 8], rtol=1e-4, atol=1e-5)
    again = decode(model, torch.stack([ids[0, 8], ids[0, 0]]), torch.tensor([8, 3]), cache)
    torch.testing.assert_close(again[0], out[0])


def test_decode_rejects_mismatched_shapes(model):
    cache = PagedKVCache(TINY, num_blocks=4, max_batch=2, block_size=4)
    with pytest.raises(ValueError, match="positions"):
        decode(model, torch.tensor([1, 2]), torch.tensor([0]), cache)


@pytest.mark.parametrize("changes,message", [
    (dict(head_dim=15), "even head_dim"),
    (dict(max_seq_len=None), "needs max_seq_len"),
])
def test_the_demo_model_refuses_a_shape_it_cannot_run(changes, message):
    import dataclasses

    with pytest.raises(ValueError, match=message):
        DemoModel(dataclasses.replace(TINY, **changes))


@pytest.mark.gpu
def test_decode_step_replays_from_a_cuda_graph(fresh):
    fresh(decode_step_replays_from_a_cuda_graph)  # a capture: in a process of its own


def decode_step_replays_from_a_cuda_graph():
    cfg = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=512, vocab=256, head_dim=32, max_seq_len=64,
                     dtype="float16")
    m = DemoModel(cfg, device="cuda")
    cache = PagedKVCache(cfg, num_blocks=16, max_batch=4, block_size=8, device="cuda")
    ids = torch.randint(0, cfg.vocab, (2, 10), device="cuda")
    prefill(m, ids, cache)
    for row in range(2):
        cache.reserve(row, 11)
    static_ids = torch.zeros(4, dtype=torch.long, device="cuda")
    static_pos = torch.zeros(4, dtype=torch.long, device="cuda")
    static_ids[:2] = ids[:, 9]
    static_pos[:2] = 10
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(m, static_ids, static_pos, cache)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode(m, static_ids, static_pos, cache)
    graph.replay()
    eager = decode(m, static_ids, static_pos, cache)
    torch.testing.assert_close(static_out[:2], eager[:2], rtol=1e-2, atol=1e-2)
