"""A model described by its shape (torch_budget.planner.shape): every field that changes the byte
counts is stated, head_dim alone is derived, and the counts match published figures."""
import dataclasses

import pytest

from torch_budget.planner.shape import (SHAPE_FIELDS, ModelShape, described_profile, estimate_activation_bytes,
                                        kv_cache_cost, parameter_count, weight_bytes)

LLAMA_3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
LLAMA_3_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256)
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=256, vocab=97, max_seq_len=40, dtype="float32")


@pytest.mark.parametrize("shape,published", [(LLAMA_3_8B, 8_030_261_248), (LLAMA_3_70B, 70_553_706_496)])
def test_parameter_count_matches_published_llama_sizes(shape, published):
    assert parameter_count(shape) == published
    assert weight_bytes(shape) == published * 2  # bfloat16


def test_head_dim_is_hidden_over_heads_unless_given():
    assert LLAMA_3_70B.head_dim == 128
    assert dataclasses.replace(LLAMA_3_70B, head_dim=64).head_dim == 64


def test_kv_bytes_per_token_are_k_and_v_per_kv_head_per_layer():
    # 2 (K and V) x 80 layers x 8 KV heads x 128 x 2 bytes; split over 8 ranks.
    assert kv_cache_cost(LLAMA_3_70B).slope == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_cache_cost(LLAMA_3_70B).shard(8).slope == 40_960
    assert kv_cache_cost(dataclasses.replace(LLAMA_3_70B, dtype="float32")).slope == 2 * 80 * 8 * 128 * 4


def test_max_seq_len_is_not_assumed():
    assert LLAMA_3_70B.max_seq_len is None and kv_cache_cost(LLAMA_3_70B).max_tokens_per_request is None
    assert kv_cache_cost(TINY).max_tokens_per_request == 40


@pytest.mark.parametrize("changes,message", [
    (dict(heads=6, kv_heads=4, hidden=96), "model heads \\(6\\) must be a multiple of kv_heads \\(4\\)"),
    (dict(dtype="int3"), "model dtype 'int3'"),
    (dict(layers=0), "model layers must be >= 1"),
    (dict(hidden=100, heads=3, kv_heads=3, head_dim=None),
     "head_dim cannot be derived: hidden \\(100\\) is not a multiple of heads \\(3\\)"),
    (dict(max_seq_len=0), "model max_seq_len must be >= 1"),
])
def test_a_shape_rejects_bad_values_by_name(changes, message):
    values = {**TINY.to_dict(), **changes}
    with pytest.raises(ValueError, match=message):
        ModelShape(**values)


def test_from_dict_rejects_unknown_keys_before_anything_else():
    with pytest.raises(ValueError, match=r"unknown model key\(s\) \['hiddn'\]"):
        ModelShape.from_dict({"hiddn": 4})


def test_from_dict_names_every_missing_shape_field():
    assert ModelShape.missing({"hidden": 8192, "heads": 64, "layers": None}) == ["layers", "kv_heads", "intermediate",
                                                                                   "vocab"]
    with pytest.raises(ValueError, match="missing: layers, kv_heads, intermediate, vocab"):
        ModelShape.from_dict({"hidden": 8192, "heads": 64})
    assert SHAPE_FIELDS == ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


def test_a_shape_round_trips_through_its_dict():
    assert ModelShape.from_dict(TINY.to_dict()) == TINY


def test_activation_estimate_grows_with_tokens():
    small = estimate_activation_bytes(TINY, 64, 4)
    large = estimate_activation_bytes(TINY, 256, 4)
    assert 0 < small < large
    with pytest.raises(ValueError):
        estimate_activation_bytes(TINY, 0)


def test_described_profile_says_where_each_figure_came_from():
    prof, notes = described_profile(TINY, total=1 << 30, num_tokens=64, weights=4096)
    assert prof.model_bytes == 4096 and notes["weights"] == "given"
    assert notes["activations"].startswith("estimated from shapes") and notes["non-torch"].startswith("not measured")
