"""The planner on Hugging Face transformers decoders: Llama- and Qwen-shaped models built with
random weights from a config (nothing is downloaded), with their own KV cache (transformers'
`StaticCache`), profiled and planned as a serving engine would.

transformers is imported only when a function here needs it (`require_transformers`), so the
planner imports without it. `MODELS` names configurations of public models by their shapes
(sizes, grouped-query attention, context length); any config transformers builds works too.

Note [Planning an HF model]
A StaticCache holds [batch, kv_heads, max_len, head_dim] K and V per layer from the start and
writes them in place, and its rows move in lock-step (one position for the whole cache). So the
worst case is fixed by (batch, prompt_len, max_len): a prefill of `batch` prompts of
`prompt_len` tokens, then decode steps whose attention always spans the whole `max_len` (a
decode step's transient memory does not depend on the position). The profiling step is that
prefill plus one decode step, on a cache of the worst case's own shape; the cache existed only
for the estimate and is handed back to the KV budget (`estimation_kv_bytes`), and the KV line is
capped at exactly that cache's bytes (measured: its tensors and the per-layer counters), so a
serving cache of the same shape fills its line and one sequence more passes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch_budget.planner.costs import CacheCost
from torch_budget.planner.shape import DTYPE_BYTES, ModelShape

__all__ = ["HFModel", "MODELS", "require_transformers", "make_config", "head_dim", "kv_cost", "model_shape",
           "weight_bytes", "build", "static_cache", "StaticCacheResource"]


@dataclass(frozen=True)
class HFModel:
    """A decoder by its transformers config (`model_type` and the fields that set its shape) and
    the worst case it is served at: `batch` sequences of `prompt_len` prompt tokens, up to
    `max_len` tokens each, `new_tokens` of them decoded by the serving run."""

    model_type: str
    config: dict
    batch: int
    prompt_len: int
    max_len: int
    new_tokens: int = 8
    shape_of: str = ""  # the public model whose shape this is
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0 < self.prompt_len < self.max_len or self.prompt_len + self.new_tokens > self.max_len:
            raise ValueError(f"{self.shape_of or self.model_type}: need 0 < prompt_len < max_len and "
                             f"prompt_len + new_tokens <= max_len, got {self.prompt_len}, {self.new_tokens}, "
                             f"{self.max_len}")


# Shapes of public checkpoints (their config.json figures), with random weights.
MODELS = {
    "llama-3.2-1b": HFModel("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                          max_position_embeddings=131072, tie_word_embeddings=True,
                                          rope_theta=500000.0), batch=16, prompt_len=2048, max_len=8192,
                            shape_of="Llama-3.2-1B"),
    "llama-3.1-8b": HFModel("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                          max_position_embeddings=131072, tie_word_embeddings=False,
                                          rope_theta=500000.0), batch=8, prompt_len=2048, max_len=16384,
                            shape_of="Llama-3.1-8B"),
    "qwen2.5-1.5b": HFModel("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                          max_position_embeddings=32768, tie_word_embeddings=True,
                                          rope_theta=1000000.0), batch=8, prompt_len=4096, max_len=32768,
                            shape_of="Qwen2.5-1.5B"),
    "qwen3-4b": HFModel("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      max_position_embeddings=40960, tie_word_embeddings=True,
                                      rope_theta=1000000.0), batch=4, prompt_len=4096, max_len=32768,
                        shape_of="Qwen3-4B"),
}


def require_transformers():
    """The transformers module, or ImportError saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise ImportError("planning a Hugging Face model needs transformers: pip install transformers") from None
    return transformers


def make_config(model: HFModel | str, **overrides):
    """The transformers config of `model` (an HFModel or a MODELS name), with `overrides` (e.g.
    num_hidden_layers=2 for a test), using PyTorch's SDPA attention."""
    model = MODELS[model] if isinstance(model, str) else model
    transformers = require_transformers()
    config = transformers.AutoConfig.for_model(model.model_type, **{**model.config, **model.extra, **overrides})
    config._attn_implementation = "sdpa"
    return config


def head_dim(config) -> int:
    """A config's head size: its own `head_dim` when it states one (Qwen3: not hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_shape(config, dtype: str = "bfloat16") -> ModelShape:
    """The planner's shape of a config, for its KV cost and activation estimate. Its parameter
    count is the planner's Llama layout; `weight_bytes` counts the model itself."""
    return ModelShape(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                      kv_heads=config.num_key_value_heads, intermediate=config.intermediate_size,
                      vocab=config.vocab_size, head_dim=head_dim(config),
                      max_seq_len=config.max_position_embeddings, dtype=dtype)


def kv_cost(config, dtype: str = "bfloat16") -> CacheCost:
    """KV bytes per cached token: one K and one V vector per KV head per layer, a K and a V tensor
    per layer (as transformers' caches allocate them)."""
    slope = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * DTYPE_BYTES[dtype]
    return CacheCost(slope=slope, tensors=2 * config.num_hidden_layers,
                     max_tokens_per_request=config.max_position_embeddings)


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def build(config, *, dtype: str = "bfloat16", device="cpu", seed: int = 0):
    """The model of `config` with random weights from `seed`, created on `device` (no copy from
    the host), in eval mode. Device "meta" builds it without memory."""
    import torch

    transformers = require_transformers()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    return model.eval()


def weight_bytes(model_or_config, dtype: str = "bfloat16") -> int:
    """Bytes of a model's parameters and buffers, each storage once (tied embeddings share one);
    from a config, of the model built on the meta device (exact for any architecture: biases,
    q/k norms, tied heads)."""
    model = model_or_config
    if not hasattr(model, "parameters"):
        model = build(model_or_config, dtype=dtype, device="meta")
    sizes = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "meta":  # no storage to tell tied tensors by: they are one object
            sizes[id(t)] = t.numel() * t.element_size()
        else:
            sizes[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def static_cache(config, *, batch: int, max_len: int, dtype: str = "bfloat16", device="cpu"):
    """transformers' StaticCache for `batch` sequences of up to `max_len` tokens, its tensors
    allocated now (early_initialization), so that the caller's region charges them."""
    import torch

    transformers = require_transformers()
    cache = transformers.StaticCache(config=config, max_cache_len=max_len)
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, head_dim=head_dim(config),
                               dtype=_torch_dtype(dtype), device=torch.device(device))
    return cache


class StaticCacheResource:
    """A StaticCache's rows as a resource manager (Note [Resource managers] in
    torch_budget/resources.py): a token is a KV slot, and a request holds a whole row of
    `max_len` slots. Rows move in lock-step (one position for the cache), so requests join only
    an empty cache: while any row is held nothing is free, and the last `free` resets the cache.
    `prompt_len` and `new_tokens` are the worst case the dummy requests make."""

    def __init__(self, cache, *, batch: int, max_len: int, prompt_len: int, new_tokens: int, tag: str = "kv"):
        self.cache, self.batch, self.max_len = cache, batch, max_len
        self.prompt_len, self.new_tokens, self.tag = prompt_len, new_tokens, tag
        self._rows: dict[int, int] = {}

    def row_of(self, request) -> int:
        return self._rows[request.request_id]

    def capacity_tokens(self) -> int:
        return self.batch * self.max_len

    def free_tokens(self) -> int:
        return 0 if self._rows else self.capacity_tokens()

    def tokens_to_completion(self, request) -> int:
        if request.prompt_len + request.max_new_tokens > self.max_len:
            return self.capacity_tokens() + 1  # longer than a row: no cache of this shape holds it
        return 0 if request.request_id in self._rows else self.max_len

    def dummy_requests(self) -> list:
        from torch_budget.resources import DummyRequest

        return [DummyRequest(i, self.prompt_len, self.new_tokens) for i in range(self.batch)]

    def prepare(self, step) -> None:
        from torch_budget.errors import StateError

        fresh = [r for r in step.context if r.request_id not in self._rows]
        if fresh and self._rows and len(fresh) != len(step.context):
            raise StateError("a StaticCache's rows move in lock-step: new requests join only an empty cache")
        if len(self._rows) + len(fresh) > self.batch:
            raise StateError(f"{len(self._rows) + len(fresh)} requests scheduled on a StaticCache of {self.batch} rows")
        for request in fresh:
            self._rows[request.request_id] = len(self._rows)

    def update(self, step) -> None:
        """Nothing to do: the cache writes its slots in place."""

    def free(self, request) -> None:
        if self._rows.pop(request.request_id, None) is not None and not self._rows:
            self.cache.reset()
