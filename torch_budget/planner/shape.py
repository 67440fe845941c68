"""A model described by its shape, for planning without a device: how many parameters it has,
what its KV cache costs per token, and what one prefill's activations may hold.

The shape is a Llama-shaped decoder (the layout of most served models): token embeddings; per
layer a query, key, value and output projection, a gated MLP of three matrices and two norms;
a final norm and an untied LM head. Every field that changes the byte counts must be stated:
a default that is right for one model is a silently wrong plan for the next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch_budget._validate import INT64_MAX, positive_int
from torch_budget.planner.costs import CacheCost
from torch_budget.planner.measure import Profile

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# The fields without which parameters or KV bytes cannot be counted. head_dim is one too, but it
# can be derived (hidden / heads); max_seq_len and dtype are settings of the serving run.
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only model. `head_dim` None means hidden / heads; `max_seq_len`
    (the longest sequence one request may hold) None means not stated, which only a per-token
    workspace reserve needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int  # MLP width
    vocab: int
    head_dim: int | None = None
    max_seq_len: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in SHAPE_FIELDS:
            positive_int(getattr(self, name), f"model {name}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"model head_dim cannot be derived: hidden ({self.hidden}) is not a multiple of "
                                 f"heads ({self.heads}); give head_dim too")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        positive_int(self.head_dim, "model head_dim")
        if self.max_seq_len is not None:
            positive_int(self.max_seq_len, "model max_seq_len")
        if self.heads % self.kv_heads:
            raise ValueError(f"model heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}): "
                             "each KV head serves a whole group of query heads")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def unknown(cls, values: dict) -> list[str]:
        """The keys of `values` that are no field of a shape, sorted."""
        return sorted(set(values) - {f.name for f in dataclasses.fields(cls)})

    @classmethod
    def missing(cls, values: dict) -> list[str]:
        """The shape fields `values` lacks (None counts as absent), in SHAPE_FIELDS order."""
        return [name for name in SHAPE_FIELDS if values.get(name) is None]

    @classmethod
    def from_dict(cls, values: dict) -> "ModelShape":
        """Build from a JSON-style dict. An unknown key is an error rather than ignored (a
        misspelt key would plan another model), and so is a missing shape field."""
        unknown = cls.unknown(values)
        if unknown:
            known = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"unknown model key(s) {unknown}; known keys are {', '.join(known)}")
        missing = cls.missing(values)
        if missing:
            raise ValueError(f"a model shape needs {', '.join(SHAPE_FIELDS)}; missing: {', '.join(missing)}")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parameter_count(shape: ModelShape) -> int:
    """The parameters of the decoder the shape describes (the module docstring's layout)."""
    q = shape.hidden * shape.heads * shape.head_dim
    kv = 2 * shape.hidden * shape.kv_heads * shape.head_dim
    o = shape.heads * shape.head_dim * shape.hidden
    mlp = 3 * shape.hidden * shape.intermediate
    norms = 2 * shape.hidden
    per_layer = q + kv + o + mlp + norms
    return shape.vocab * shape.hidden + shape.layers * per_layer + shape.hidden + shape.hidden * shape.vocab


def weight_bytes(shape: ModelShape) -> int:
    """Bytes the weights occupy on the device: the first line of the ledger."""
    return parameter_count(shape) * shape.itemsize


def kv_cache_cost(shape: ModelShape) -> CacheCost:
    """KV bytes per token: one K and one V vector per KV head per layer. No per-request state
    that is independent of length, so the intercept is 0; a K and a V tensor per layer."""
    slope = 2 * shape.layers * shape.kv_heads * shape.head_dim * shape.itemsize
    return CacheCost(slope=slope, intercept=0, tensors=2 * shape.layers, max_tokens_per_request=shape.max_seq_len)


def estimate_activation_bytes(shape: ModelShape, num_tokens: int, num_sequences: int = 1) -> int:
    """Shape-based estimate of the peak activation bytes of one prefill of `num_tokens` tokens
    split over `num_sequences` equal sequences, for planning without a device.

    The residual stream and its normalised copy stay live while the larger of the attention
    block (q, k, v, GQA-expanded k and v, the attention output) or the MLP block (gate, up,
    their product) is live; attention scores are counted as if materialised (the math path),
    and logits are computed for the last token of each sequence. A measured `profile()`
    replaces this whenever a device is available.
    """
    if num_tokens <= 0 or num_sequences <= 0:
        raise ValueError(f"num_tokens and num_sequences must be positive, got {num_tokens} and {num_sequences}")
    n = num_tokens
    seq = -(-num_tokens // num_sequences)
    qo = 2 * n * shape.heads * shape.head_dim
    kv = 2 * n * shape.kv_heads * shape.head_dim + 2 * n * shape.heads * shape.head_dim
    scores = num_sequences * shape.heads * seq * seq
    attention = qo + kv + scores
    mlp = 3 * n * shape.intermediate
    residual = 2 * n * shape.hidden
    logits = num_sequences * shape.vocab
    return (residual + max(attention, mlp) + logits) * shape.itemsize


def described_profile(shape: ModelShape, *, total: int, num_tokens: int, num_sequences: int = 1,
                      weights: int | None = None, activations: int | None = None,
                      non_torch: int = 0) -> tuple[Profile, dict]:
    """What one worst-case prefill of this model would hold on a card of `total` bytes, for
    planning without a device: weights computed from the shape and activations estimated from
    shapes for `num_tokens` tokens in `num_sequences` sequences, unless given; memory outside
    torch as given (0 when unknown); no allocator cache (torch reserved taken as its peak).
    Returns the profile and, per ledger line, where its figure came from (the `notes` of
    `plan`)."""
    w = weight_bytes(shape) if weights is None else weights
    if activations is None:
        a = estimate_activation_bytes(shape, num_tokens, num_sequences)
        act_note = f"estimated from shapes for {num_tokens} tokens in {num_sequences} sequence(s)"
    else:
        a, act_note = activations, "given"
    if w + a + non_torch > INT64_MAX:
        # Said here, in the caller's terms: the profile would refuse the sum by its own field's name.
        raise ValueError(f"the described model needs {w + a + non_torch} bytes (weights {w}, activations {a}: "
                         f"{act_note}), past any card (2**63 bytes): lower the token count or the shape")
    prof = Profile.from_measurements(torch_peak=w + a, torch_used=w + a, total_used=w + a + non_torch, total=total,
                                     model_bytes=w, source="described model, no device")
    notes = {
        "weights": "computed from the shape" if weights is None else "given",
        "activations": act_note,
        "non-torch": "given" if non_torch else "not measured, taken as 0",
        "allocator cache": "not measured, taken as 0",
    }
    return prof, notes
