"""The demo's model: a small decoder-only transformer with random weights, so the demo and the
GPU tests have a real model to budget without downloading anything, and its paged KV cache.

Llama-shaped (RMSNorm, rotary positions, grouped-query attention, gated MLP, untied LM head),
so `torch_budget.planner.shape` counts its parameters and KV bytes exactly. Its KV cache is
paged and sized from a byte budget through the same `CacheCost` the planner uses, and its
one-token decode step has static shapes and writes the cache in place, so the step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from torch_budget.planner.costs import ALLOCATION_UNIT
from torch_budget.planner.shape import ModelShape, kv_cache_cost

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _checked(cfg: ModelShape) -> ModelShape:
    """What this module needs of a shape beyond what the planner does."""
    if cfg.max_seq_len is None:
        raise ValueError("the demo model needs max_seq_len: its rotary tables and block tables are sized by it")
    if cfg.head_dim % 2:
        raise ValueError(f"the demo model needs an even head_dim for rotary positions, got {cfg.head_dim}")
    return cfg


class PagedKVCache:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots per layer.

    Block 0 is a null block that is never handed out. Unassigned block-table entries point at it,
    so padded batch rows in a captured decode step write there instead of into a live sequence.
    Block tables are one static tensor ([max_batch, blocks_per_seq]) that is edited in place, so a
    captured graph that read it keeps seeing the current assignment.
    """

    def __init__(self, cfg: ModelShape, num_blocks: int, *, max_batch: int, block_size: int = 16, device=None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if num_blocks < 2:
            raise ValueError(
                f"a paged KV cache needs at least 2 blocks (one is the null block), got num_blocks={num_blocks}"
            )
        self.cfg = _checked(cfg)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch = max_batch
        self.blocks_per_seq = -(-cfg.max_seq_len // block_size)
        shape = (cfg.layers, num_blocks * block_size, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=DTYPES[cfg.dtype], device=device)
        self.v = torch.zeros(shape, dtype=DTYPES[cfg.dtype], device=device)
        self.block_tables = torch.zeros((max_batch, self.blocks_per_seq), dtype=torch.long, device=device)
        # Host-side mirror of which blocks each row owns; the device table is only written, never read back.
        self._owned: list[list[int]] = [[] for _ in range(max_batch)]
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))

    @staticmethod
    def table_bytes(cfg: ModelShape, max_batch: int, block_size: int) -> int:
        """Bytes of the block tables: allocated with the pool, under the same tag."""
        return max_batch * -(-cfg.max_seq_len // block_size) * 8  # int64 entries

    @classmethod
    def from_budget(cls, cfg: ModelShape, budget_bytes: int, *, max_batch: int, block_size: int = 16, device=None):
        """Size the cache from a byte budget (e.g. `Plan.kv_bytes`, the KV tag's budget under
        Plan.apply()) via `CacheCost.tokens_for_tag_budget`, rounded down to whole blocks, after the
        block tables: the pool and its tables together never exceed the budget."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        # Two tensors (K and V, every layer in each), and the tables, as the allocator charges them.
        cost = dataclasses.replace(kv_cache_cost(_checked(cfg)), tensors=2)
        tables = cls.table_bytes(cfg, max_batch, block_size)
        unit = ALLOCATION_UNIT
        tokens = cost.tokens_for_tag_budget(budget_bytes - (tables + unit - 1) // unit * unit)
        num_blocks = tokens // block_size
        if num_blocks < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds {tokens} tokens at {cost.slope} bytes/token beside "
                f"{tables} bytes of block tables, fewer than the 2 blocks of {block_size} tokens a paged cache "
                "needs; raise the budget"
            )
        return cls(cfg, num_blocks, max_batch=max_batch, block_size=block_size, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_of(self, row: int) -> int:
        """Blocks `row` owns now."""
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} out of range for max_batch={self.max_batch}")
        return len(self._owned[row])

    def reserve(self, row: int, num_tokens: int) -> None:
        """Make sure `row` owns blocks for its first `num_tokens` positions. Call before a decode
        step writes position `num_tokens - 1`; this is the only place blocks are handed out, and it
        runs outside any captured graph."""
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} out of range for max_batch={self.max_batch}")
        if not 0 <= num_tokens <= self.cfg.max_seq_len:
            raise ValueError(f"num_tokens {num_tokens} outside [0, max_seq_len={self.cfg.max_seq_len}]")
        needed = -(-num_tokens // self.block_size) - len(self._owned[row])
        if needed > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: row {row} needs {needed} more blocks of {self.block_size} tokens, "
                f"{len(self._free)} free of {self.num_blocks - 1}; defer the request or raise the KV budget"
            )
        for _ in range(max(needed, 0)):
            block = self._free.pop()
            self.block_tables[row, len(self._owned[row])] = block
            self._owned[row].append(block)

    def release(self, row: int) -> None:
        """Give `row`'s blocks back and point its table at the null block again."""
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} out of range for max_batch={self.max_batch}")
        self._free.extend(reversed(self._owned[row]))
        self._owned[row].clear()
        self.block_tables[row].zero_()

    def reset(self) -> None:
        """Hand every block back in its first order, point every row at the null block and zero
        the pool: the state of a new cache. Needed after the cache's memory was restored without
        a backup (torch_budget.sleep): its contents are then undefined, and decode reads masked
        slots too, where a NaN would turn softmax's zero weights into NaN."""
        self.k.zero_()
        self.v.zero_()
        self.block_tables.zero_()
        for owned in self._owned:
            owned.clear()
        self._free = list(range(self.num_blocks - 1, 0, -1))

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot index of each (row, position) pair; shapes broadcast, no host sync."""
        blocks = self.block_tables[rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., heads, head_dim]; cos/sin: [..., head_dim // 2], broadcast over heads.
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class DemoModel(torch.nn.Module):
    """The built-in decoder. Random weights from `seed`; use `prefill` and `decode` to run it."""

    def __init__(self, cfg: ModelShape, *, device=None, seed: int = 0):
        super().__init__()
        self.cfg = _checked(cfg)
        gen = torch.Generator().manual_seed(seed)
        dtype = DTYPES[cfg.dtype]

        def param(*shape, std=0.02, ones=False):
            t = torch.ones(shape) if ones else torch.randn(shape, generator=gen) * std
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        qd, kvd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = param(cfg.vocab, cfg.hidden)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.layers):
            layer = torch.nn.Module()
            layer.attn_norm = param(cfg.hidden, ones=True)
            layer.wq = param(qd, cfg.hidden)
            layer.wk = param(kvd, cfg.hidden)
            layer.wv = param(kvd, cfg.hidden)
            layer.wo = param(cfg.hidden, qd)
            layer.mlp_norm = param(cfg.hidden, ones=True)
            layer.w_gate = param(cfg.intermediate, cfg.hidden)
            layer.w_up = param(cfg.intermediate, cfg.hidden)
            layer.w_down = param(cfg.hidden, cfg.intermediate)
            self.layers.append(layer)
        self.final_norm = param(cfg.hidden, ones=True)
        self.lm_head = param(cfg.vocab, cfg.hidden)

        # Rotary tables are computed in float32 and cast once; decode gathers rows by position.
        inv = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv)
        self.register_buffer("rope_cos", angles.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(device=device, dtype=dtype), persistent=False)

    def _mlp(self, layer, x):
        h = _rms_norm(x, layer.mlp_norm)
        return x + F.linear(F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up), layer.w_down)

    def _logits(self, x):
        return F.linear(_rms_norm(x, self.final_norm), self.lm_head)


def prefill_shape(cfg: ModelShape, token_ids) -> tuple:
    """(batch, length) of a prefill's token ids [B, T], checked against the model's limits."""
    if token_ids.dim() != 2:
        raise ValueError(f"prefill expects token_ids of shape [B, T], got {tuple(token_ids.shape)}")
    batch, length = token_ids.shape
    if length > cfg.max_seq_len:
        raise ValueError(f"prefill length {length} exceeds max_seq_len={cfg.max_seq_len}")
    return batch, length


def prefill_workspace_bytes(cfg: ModelShape, batch: int, length: int) -> int:
    """Bytes one layer of `prefill` asks its scratch for: the GQA-expanded K and V."""
    return 2 * batch * length * cfg.heads * cfg.head_dim * cfg.itemsize


@torch.no_grad()
def prefill(model: DemoModel, token_ids: torch.Tensor, cache: PagedKVCache, rows=None, *, scratch=None,
            last_only: bool = False) -> torch.Tensor:
    """Run `token_ids` ([B, T], positions 0..T-1) through the model, write their K/V into `rows`
    of the cache (default 0..B-1; blocks for T positions are reserved here unless the row owns
    them: a row another request used must be released first), and return logits [B, T, vocab], or
    [B, vocab] for the last position only with `last_only` (all a server samples from).

    `scratch`, when given, provides each layer's GQA-expanded K and V: an object whose
    `get(nbytes)` returns a uint8 tensor of at least `nbytes` (prefill_workspace_bytes), such as
    a `torch_budget.WorkspaceMetadata` inside `torch_budget.workspace(...)`; one scratch then
    grows to the largest layer's need, not the sum. Without it they are allocated per layer.

    Prefill is eager (its shape varies with T), so it may hand out cache blocks.
    """
    cfg = model.cfg
    batch, length = prefill_shape(cfg, token_ids)
    device = token_ids.device
    rows_t = torch.arange(batch, device=device) if rows is None else torch.as_tensor(rows, device=device)
    if rows_t.shape != (batch,):
        raise ValueError(f"rows must have one entry per sequence ({batch}), got shape {tuple(rows_t.shape)}")
    for row in rows_t.tolist():
        cache.reserve(row, length)  # blocks a row owns already are kept (a scheduler reserved them)

    positions = torch.arange(length, device=device)
    slots = cache.slots(rows_t[:, None], positions[None, :]).reshape(-1)
    cos, sin = model.rope_cos[:length], model.rope_sin[:length]
    group = cfg.heads // cfg.kv_heads
    expanded = batch * length * cfg.heads * cfg.head_dim
    x = F.embedding(token_ids, model.embed)
    for i, layer in enumerate(model.layers):
        h = _rms_norm(x, layer.attn_norm)
        q = _rotate(F.linear(h, layer.wq).view(batch, length, cfg.heads, cfg.head_dim), cos, sin)
        k = _rotate(F.linear(h, layer.wk).view(batch, length, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = F.linear(h, layer.wv).view(batch, length, cfg.kv_heads, cfg.head_dim)
        cache.k[i].index_copy_(0, slots, k.reshape(-1, cfg.kv_heads, cfg.head_dim))
        cache.v[i].index_copy_(0, slots, v.reshape(-1, cfg.kv_heads, cfg.head_dim))
        if scratch is None:
            k_all, v_all = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        else:
            # Head h = kv * group + g: the order repeat_interleave(group, dim=2) gives.
            buf = scratch.get(prefill_workspace_bytes(cfg, batch, length)).view(DTYPES[cfg.dtype])
            k_all = buf[:expanded].view(batch, length, cfg.kv_heads, group, cfg.head_dim)
            v_all = buf[expanded:2 * expanded].view(batch, length, cfg.kv_heads, group, cfg.head_dim)
            k_all.copy_(k.unsqueeze(3).expand(-1, -1, -1, group, -1))
            v_all.copy_(v.unsqueeze(3).expand(-1, -1, -1, group, -1))
            k_all = k_all.view(batch, length, cfg.heads, cfg.head_dim)
            v_all = v_all.view(batch, length, cfg.heads, cfg.head_dim)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                              is_causal=True)
        x = x + F.linear(attn.transpose(1, 2).reshape(batch, length, -1), layer.wo)
        x = model._mlp(layer, x)
    return model._logits(x[:, -1] if last_only else x)


@torch.no_grad()
def decode(model: DemoModel, token_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
    """One decode step for B sequences in cache rows 0..B-1: token_ids [B] at positions [B].

    Writes each token's K/V into the cache in place and attends over the row's whole block table
    with a position mask, so every shape depends only on B and max_seq_len: no host sync, no
    allocation that depends on data, hence capturable in a CUDA graph. Blocks for `positions`
    must have been reserved (`cache.reserve(row, pos + 1)`) beforehand. Returns logits [B, vocab].
    """
    cfg = model.cfg
    if token_ids.dim() != 1 or positions.shape != token_ids.shape:
        raise ValueError(
            f"decode expects token_ids [B] and positions [B], got {tuple(token_ids.shape)} and {tuple(positions.shape)}"
        )
    batch = token_ids.shape[0]
    if batch > cache.max_batch:
        raise ValueError(f"decode batch {batch} exceeds the cache's max_batch={cache.max_batch}")
    device = token_ids.device
    rows = torch.arange(batch, device=device)
    slot = cache.slots(rows, positions)
    span = cache.blocks_per_seq * cache.block_size
    offsets = torch.arange(span, device=device)
    all_slots = (cache.block_tables[:batch, :, None] * cache.block_size + offsets[: cache.block_size]).reshape(batch, span)
    masked = offsets[None, :] > positions[:, None]  # [B, span]: future or unused slots
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    group = cfg.heads // cfg.kv_heads
    scale = 1.0 / math.sqrt(cfg.head_dim)

    x = F.embedding(token_ids, model.embed)
    for i, layer in enumerate(model.layers):
        h = _rms_norm(x, layer.attn_norm)
        q = _rotate(F.linear(h, layer.wq).view(batch, cfg.heads, cfg.head_dim), cos, sin)
        k = _rotate(F.linear(h, layer.wk).view(batch, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = F.linear(h, layer.wv).view(batch, cfg.kv_heads, cfg.head_dim)
        cache.k[i].index_copy_(0, slot, k)
        cache.v[i].index_copy_(0, slot, v)
        keys = cache.k[i][all_slots]  # [B, span, kv_heads, head_dim]
        values = cache.v[i][all_slots]
        qg = q.view(batch, cfg.kv_heads, group, cfg.head_dim)
        scores = torch.einsum("bhgd,bshd->bhgs", qg.float(), keys.float()) * scale
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        attn = torch.einsum("bhgs,bshd->bhgd", probs, values.float()).to(x.dtype)
        x = x + F.linear(attn.reshape(batch, -1), layer.wo)
        x = model._mlp(layer, x)
    return model._logits(x)
