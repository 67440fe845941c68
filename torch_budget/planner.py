"""The budget planner: cut one card into budgets that do not overlap.

A budget error found at start-up is an OOM mid-forward later, so the planner measures what one
forward really holds (`profile`), sets aside what will appear beside or after it, and gives the
KV cache - the only part that grows - what is left (`plan`). Every number it produces is a line
of the ledger with the reason it has that size.

See Note [Planner steps] on `plan` for the order of the steps and why it matters.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from torch_budget._validate import fraction as _fraction, integer, non_negative_int, number
from torch_budget.report.ledger import CATEGORIES, LedgerLine, format_table
from torch_budget.units import format_bytes

# The card planned for when there is no device to measure and none was named: an assumption,
# printed as one wherever it is used.
ASSUMED_CARD = "NVIDIA H200"
ASSUMED_CARD_GIB = 139.8  # nominally 141 GB; the usable figure is itself assumed

__all__ = [
    "CacheCost",
    "WorkspaceReserve",
    "workspace_reserve",
    "attended_token_cap",
    "Reserve",
    "Profile",
    "profile",
    "PlanStep",
    "Plan",
    "plan",
]


@dataclass(frozen=True)
class CacheCost:
    """What a KV cache costs: `bytes = slope * tokens + intercept`.

    slope: bytes per cached token (all layers, K and V). intercept: per-request state that does
    not grow with length (e.g. recurrent state). The remaining fields are per-request policy of
    one cache; they are meaningless for a sum of caches and are dropped by `+`.
    """

    slope: int
    intercept: int = 0
    max_tokens_per_request: int | None = None  # policy: longest sequence one request may hold
    policy: str | None = None  # policy: name of the cache's admission/eviction policy

    def __post_init__(self):
        for name in ("slope", "intercept"):
            number(getattr(self, name), f"CacheCost.{name}")
        if self.intercept < 0:
            raise ValueError(f"CacheCost.intercept must be >= 0, got {self.intercept}")

    def bytes_for_tokens(self, tokens: int) -> int:
        non_negative_int(tokens, "tokens")
        return self.slope * tokens + self.intercept

    def tokens_for_budget(self, budget_bytes: int) -> int:
        """Largest token count whose cost fits `budget_bytes`; 0 when nothing fits or the cache
        does not grow with tokens (slope <= 0 would otherwise divide by zero or go negative)."""
        if self.slope <= 0:
            return 0
        return max(int((budget_bytes - self.intercept) // self.slope), 0)

    def __add__(self, other: "CacheCost") -> "CacheCost":
        # Two caches side by side (e.g. attention KV + recurrent state): costs add, policies don't.
        if not isinstance(other, CacheCost):
            return NotImplemented
        return CacheCost(slope=self.slope + other.slope, intercept=self.intercept + other.intercept)

    def shard(self, ways: int) -> "CacheCost":
        """Per-rank cost when tensor or context parallelism splits every token's KV `ways` ways.

        Only the slope changes (rounded up, so a rank never under-counts); `dataclasses.replace`
        keeps every other field, including ones added later.
        """
        integer(ways, "ways", minimum=1)
        slope = -(-self.slope // ways) if isinstance(self.slope, int) else math.ceil(self.slope / ways)
        return dataclasses.replace(self, slope=slope)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CacheCost":
        return cls(**d)


@dataclass(frozen=True)
class WorkspaceReserve:
    bytes: int  # set aside from the KV budget for the per-token workspace
    tokens: int  # admission cap: attended tokens per step; requests above it are deferred


def attended_token_cap(max_batch: int, max_num_tokens: int, max_seq_len: int, user_cap: int | None = None) -> int:
    """The attended-token cap L of the per-token workspace.

    Default: every sequence of the largest batch attends a full context,
    `min(max_batch, max_num_tokens) * max_seq_len`. A user cap is floored at `max_seq_len`
    (one full-length request must always be admissible) and capped at that default (a larger
    cap could never be reached, it would only take memory from the KV cache).
    """
    for name, value in (("max_batch", max_batch), ("max_num_tokens", max_num_tokens), ("max_seq_len", max_seq_len)):
        integer(value, name, minimum=1)
    default = min(max_batch, max_num_tokens) * max_seq_len
    if user_cap is None:
        return default
    integer(user_cap, "user_cap")
    return min(max(user_cap, max_seq_len), default)


def workspace_reserve(kv_bytes_per_token, workspace_bytes_per_token, budget_bytes, token_cap) -> WorkspaceReserve:
    """Split a budget between the KV cache and a workspace that grows with attended tokens.

    With k = KV bytes/token, w = workspace bytes/attended token, B = budget, L = cap:
    `reserve = min(w*L, B*w/(k+w))` - the workspace never needs more than its cap, and beyond
    that the split keeps workspace and KV in proportion so that every cached token can also be
    attended. Admission cap = `reserve / w` tokens. Any non-positive input means there is no
    such workspace (or nothing to split): no reserve.
    """
    k, w, b, cap = kv_bytes_per_token, workspace_bytes_per_token, budget_bytes, token_cap
    if k <= 0 or w <= 0 or b <= 0 or cap <= 0:
        return WorkspaceReserve(0, 0)
    reserve = int(min(w * cap, (b * w) // (k + w)))
    return WorkspaceReserve(reserve, int(reserve // w))


@dataclass(frozen=True)
class Reserve:
    """Bytes set aside for something the profiling forward did not hold, with the reason.

    `category` is its ledger category (e.g. "graph_pools" for graphs captured after the KV pool).
    """

    name: str
    bytes: int
    reason: str
    category: str = "reserve"

    def __post_init__(self):
        non_negative_int(self.bytes, f"Reserve({self.name!r}).bytes")
        if self.category not in CATEGORIES or self.category in ("headroom", "kv_pool", "weights"):
            raise ValueError(f"Reserve({self.name!r}) category {self.category!r} is not a reservable ledger category")

    @classmethod
    def increment(cls, name: str, profiled_bytes: int, needed_bytes: int, reason: str, category: str = "reserve") -> "Reserve":
        """Reserve only what a configuration adds over what profiling already held, e.g. a
        first-request-only table that profiling allocated at a smaller size."""
        non_negative_int(profiled_bytes, "profiled_bytes")
        non_negative_int(needed_bytes, "needed_bytes")
        return cls(name, max(needed_bytes - profiled_bytes, 0), reason, category)


@dataclass(frozen=True)
class Profile:
    """What one profiling forward held. The last four fields are derived (see `from_measurements`)."""

    torch_peak: int  # allocated_bytes.all.peak over the forward, weights included
    torch_used: int  # bytes torch's allocator holds from the device (reserved) after the forward
    total_used: int  # device-wide bytes in use: total - free
    total: int  # card bytes
    model_bytes: int
    activation_bytes: int
    extra_cost: int  # memory outside torch: context, NCCL, other libraries
    peak: int
    source: str = "measured"

    @classmethod
    def from_measurements(cls, *, torch_peak: int, torch_used: int, total_used: int, total: int,
                          model_bytes: int, source: str = "given") -> "Profile":
        """Derive the profile from the four readings (also how tests and planners without a
        device inject numbers). A torch peak below the weights means the weights were not
        resident when profiling ran, which would hide their bytes: an error, not a clamp."""
        for name, value in (("torch_peak", torch_peak), ("torch_used", torch_used), ("total_used", total_used),
                            ("total", total), ("model_bytes", model_bytes)):
            non_negative_int(value, name)
        if total <= 0:
            raise ValueError(f"total card bytes must be positive, got {total}")
        if torch_peak < model_bytes:
            raise ValueError(
                f"torch peak ({torch_peak} bytes) is below model_bytes ({model_bytes}): load the weights "
                "before profiling, or pass the bytes the weights really occupy"
            )
        extra = max(total_used - torch_used, 0)
        return cls(torch_peak=torch_peak, torch_used=torch_used, total_used=total_used, total=total,
                   model_bytes=model_bytes, activation_bytes=torch_peak - model_bytes, extra_cost=extra,
                   peak=torch_peak + extra, source=source)


def profile(fn: Callable, *args, model_bytes: int, device=None, **kwargs) -> Profile:
    """Run one profiling forward `fn(*args, **kwargs)` and measure what it held.

    Cached memory is released and peaks reset first, so the peak is this forward's and not an
    earlier one's. Only public torch.cuda calls are used, so this works with torch's native
    allocator and with any pluggable allocator that answers `memory_stats()` with native key
    names (as torch_budget's does after `install()`).

    torch_used is the allocator's *reserved* bytes, not its allocated bytes: blocks it caches
    after the forward are torch's, and counting them as non-torch would charge the activations
    twice.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "profile() measures a CUDA device and none is available; without one, build "
            "Profile.from_measurements(...) from known figures (or use `torch-budget plan`)"
        )
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"profile() needs a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
    del result
    missing = [k for k in ("allocated_bytes.all.peak", "reserved_bytes.all.current") if k not in stats]
    if missing:
        raise RuntimeError(
            f"torch.cuda.memory_stats() lacks {missing}; the active allocator "
            f"({torch.cuda.get_allocator_backend()}) does not report native statistics"
        )
    return Profile.from_measurements(
        torch_peak=int(stats["allocated_bytes.all.peak"]),
        torch_used=int(stats["reserved_bytes.all.current"]),
        total_used=int(total - free),
        total=int(total),
        model_bytes=model_bytes,
        source=f"measured on {dev}",
    )


@dataclass(frozen=True)
class PlanStep:
    """The KV budget after one planner step, and what the step did."""

    step: int
    name: str
    kv_bytes: int | None  # None before step 4, when there is no KV budget yet
    note: str


@dataclass
class Plan:
    """The result of `plan`: the KV budget in bytes and tokens, and a ledger that explains every
    byte of the card. `lines` add up to `total` (headroom takes the remainder)."""

    total: int
    kv_bytes: int
    kv_tokens: int
    kv_cost: CacheCost
    workspace_tokens: int  # admission cap of the per-token workspace; 0 when there is none
    fraction: float
    world_size: int
    lines: list[LedgerLine]
    steps: list[PlanStep]
    title: str = "torch_budget plan"

    def line(self, name: str) -> LedgerLine:
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(f"plan has no ledger line {name!r}; lines are {[l.name for l in self.lines]}")

    def bytes_in(self, category: str) -> int:
        return sum(line.bytes for line in self.lines if line.category == category)

    def to_text(self) -> str:
        steps = "\n".join(
            f"  {s.step}. {s.name:<12} KV budget {'-' if s.kv_bytes is None else format_bytes(s.kv_bytes):>11}  {s.note}"
            for s in self.steps
        )
        head = (f"KV cache: {format_bytes(self.kv_bytes)} = {self.kv_tokens} tokens at {self.kv_cost.slope} bytes/token"
                + (f" + {self.kv_cost.intercept} bytes/request" if self.kv_cost.intercept else ""))
        if self.workspace_tokens:
            head += f"; per-step attended-token cap {self.workspace_tokens}"
        return f"{format_table(self.lines, self.total, self.title)}\n\n{head}\nsteps:\n{steps}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kind"] = "torch_budget.plan"
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        if d.pop("kind", "torch_budget.plan") != "torch_budget.plan":
            raise ValueError("not a torch_budget plan")
        d["kv_cost"] = CacheCost.from_dict(d["kv_cost"])
        d["lines"] = [LedgerLine.from_dict(x) for x in d["lines"]]
        d["steps"] = [PlanStep(**x) for x in d["steps"]]
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _min_over_ranks(value: int, group) -> tuple[int, int]:
    """All-reduce MIN of a byte count when torch.distributed is up; (value, 1) otherwise."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value, 1
    # NCCL only reduces device tensors; every other backend takes host tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item()), dist.get_world_size(group)


def plan(
    profile: Profile,
    kv_cost: CacheCost,
    *,
    fraction: float = 0.9,
    estimation_kv_bytes: int = 0,
    beside_peak: Sequence[Reserve] = (),
    from_kv: Sequence[Reserve] = (),
    workspace_bytes_per_token: int = 0,
    max_batch: int | None = None,
    max_num_tokens: int | None = None,
    max_seq_len: int | None = None,
    attended_cap: int | None = None,
    max_kv_bytes: int | None = None,
    max_kv_tokens: int | None = None,
    eager_workspace_in_peak: int = 0,
    group=None,
    notes: dict[str, str] | None = None,
    title: str = "torch_budget plan",
) -> Plan:
    """Plan the KV budget of one card (every rank calls it when torch.distributed is up).

    Note [Planner steps]
    1-2. `profile` gives the peak: torch's peak plus what lives outside torch.
    3. `beside_peak` reserves sit next to the peak: things the profiling forward did not hold
       (capacity-sized fixed workspaces, first-request-only increments, encoder outputs).
    4. `available = (total - peak + estimation_kv_bytes) * fraction`; KV memory that existed only
       so profiling could run is counted in the peak and is given back here.
    5. `from_kv` reserves come out of the KV budget: they appear after the KV pool exists (graph
       pools, late workspaces). A workspace that grows per attended token takes its share via
       `workspace_reserve` with L from `attended_token_cap`.
    6. Hard caps (`max_kv_bytes`, `max_kv_tokens` via `kv_cost`) can only lower the budget.
    7. Across ranks the budget is the min, exchanged in bytes: ranks may have different KV costs
       per token, but a byte budget means the same thing on every rank.
    A negative budget at any step is clamped to 0; the headroom line then goes negative and
    shows by how much the card is over-committed.

    `notes` maps a ledger line name ("weights", "activations", "non-torch") to text appended to its
    reason, e.g. where a figure came from when it was not measured.
    """
    _fraction(fraction, "fraction")
    non_negative_int(estimation_kv_bytes, "estimation_kv_bytes")
    non_negative_int(workspace_bytes_per_token, "workspace_bytes_per_token")
    non_negative_int(eager_workspace_in_peak, "eager_workspace_in_peak")
    if max_kv_bytes is not None:
        non_negative_int(max_kv_bytes, "max_kv_bytes")
    if max_kv_tokens is not None:
        non_negative_int(max_kv_tokens, "max_kv_tokens")
    if estimation_kv_bytes > profile.activation_bytes:
        raise ValueError(
            f"estimation_kv_bytes ({estimation_kv_bytes}) exceeds the profiled activation bytes "
            f"({profile.activation_bytes}); it must be KV memory that existed during profiling"
        )
    if eager_workspace_in_peak > profile.activation_bytes - estimation_kv_bytes:
        raise ValueError(
            f"eager_workspace_in_peak ({eager_workspace_in_peak}) exceeds the profiled activation bytes "
            f"net of estimation KV ({profile.activation_bytes - estimation_kv_bytes})"
        )
    total = profile.total
    steps: list[PlanStep] = []

    # 1-2. the measured peak
    steps.append(PlanStep(1, "profile", None,
                          f"torch peak {format_bytes(profile.torch_peak)}, torch reserved {format_bytes(profile.torch_used)}, "
                          f"device used {format_bytes(profile.total_used)} ({profile.source})"))
    steps.append(PlanStep(2, "peak", None,
                          f"activations {format_bytes(profile.activation_bytes)}, non-torch {format_bytes(profile.extra_cost)}, "
                          f"peak {format_bytes(profile.peak)}"))

    # 3. reserves beside the peak
    beside = sum(r.bytes for r in beside_peak)
    peak = profile.peak + beside
    steps.append(PlanStep(3, "beside peak", None, f"{len(beside_peak)} reserve(s), {format_bytes(beside)}; peak {format_bytes(peak)}"))

    # 4. what is available to the KV cache
    raw = total - peak + estimation_kv_bytes
    available = max(math.floor(raw * fraction), 0)
    steps.append(PlanStep(4, "available", available,
                          f"({format_bytes(total)} - {format_bytes(peak)} + {format_bytes(estimation_kv_bytes)}) * {fraction:g}"
                          + (" clamped to 0" if raw * fraction < 0 else "")))

    # 5. reserves taken from the KV budget
    taken = sum(r.bytes for r in from_kv)
    budget = max(available - taken, 0)
    note = f"{len(from_kv)} reserve(s), {format_bytes(taken)}"
    ws = WorkspaceReserve(0, 0)
    if workspace_bytes_per_token > 0:
        if max_seq_len is None:
            max_seq_len = kv_cost.max_tokens_per_request
        if max_batch is None or max_num_tokens is None or max_seq_len is None:
            raise ValueError(
                "a per-token workspace needs max_batch, max_num_tokens and max_seq_len to bound its "
                f"attended tokens (got {max_batch}, {max_num_tokens}, {max_seq_len})"
            )
        cap = attended_token_cap(max_batch, max_num_tokens, max_seq_len, attended_cap)
        ws = workspace_reserve(kv_cost.slope, workspace_bytes_per_token, budget, cap)
        budget -= ws.bytes
        note += f"; per-token workspace {format_bytes(ws.bytes)} for {ws.tokens} attended tokens (L={cap})"
    steps.append(PlanStep(5, "from KV", budget, note))

    # 6. hard caps only lower
    uncapped = budget
    caps = []
    if max_kv_bytes is not None:
        caps.append(f"max_kv_bytes {format_bytes(max_kv_bytes)}")
        budget = min(budget, max_kv_bytes)
    if max_kv_tokens is not None:
        cap_bytes = kv_cost.bytes_for_tokens(max_kv_tokens)
        caps.append(f"max_kv_tokens {max_kv_tokens} = {format_bytes(cap_bytes)}")
        budget = min(budget, max(cap_bytes, 0))
    steps.append(PlanStep(6, "caps", budget, ", ".join(caps) if caps else "no caps"))

    # 7. min over ranks, in bytes
    capped = budget
    budget, world = _min_over_ranks(budget, group)
    steps.append(PlanStep(7, "ranks", budget, f"min over {world} rank(s)" if world > 1 else "single rank"))

    tokens = kv_cost.tokens_for_budget(budget)
    activations = profile.activation_bytes - estimation_kv_bytes - eager_workspace_in_peak
    lines = [LedgerLine("weights", "weights", profile.model_bytes, f"model parameters and buffers ({profile.source})"),
             LedgerLine("activations", "activations", activations,
                        "profiling forward's torch peak minus weights"
                        + (", estimation KV" if estimation_kv_bytes else "")
                        + (", eager workspace" if eager_workspace_in_peak else ""))]
    if eager_workspace_in_peak:
        lines.append(LedgerLine("eager workspace", "eager_workspace", eager_workspace_in_peak,
                                "held during the profiling forward (part of the torch peak)"))
    lines.append(LedgerLine("non-torch", "non_torch", profile.extra_cost,
                            "device used minus torch reserved: context, NCCL, other libraries"))
    lines += [LedgerLine(r.name, r.category, r.bytes, f"beside the peak: {r.reason}") for r in beside_peak]
    lines += [LedgerLine(r.name, r.category, r.bytes, f"from the KV budget: {r.reason}") for r in from_kv]
    if ws.bytes:
        lines.append(LedgerLine("per-token workspace", "eager_workspace", ws.bytes,
                                f"{workspace_bytes_per_token} B per attended token, admits {ws.tokens} tokens per step"))
    lines.append(LedgerLine("KV pool", "kv_pool", budget,
                            f"{tokens} tokens at {kv_cost.slope} B/token"
                            + (f" + {kv_cost.intercept} B/request" if kv_cost.intercept else "")))
    headroom = total - sum(line.bytes for line in lines)
    parts = []
    if raw > 0:
        parts.append(f"1-fraction margin {format_bytes(raw - available)}")
    if uncapped > capped:
        parts.append(f"caps {format_bytes(uncapped - capped)}")
    if capped > budget:
        parts.append(f"min over ranks {format_bytes(capped - budget)}")
    why = "left unplanned: " + (", ".join(parts) if parts else "nothing")
    if headroom < 0:
        why = "OVER-COMMITTED: the peak and reserves exceed the card by this much"
    lines.append(LedgerLine("headroom", "headroom", headroom, why))
    for name, text in (notes or {}).items():
        matches = [i for i, line in enumerate(lines) if line.name == name]
        if not matches:
            raise ValueError(f"notes name a ledger line {name!r} that the plan does not have")
        for i in matches:
            lines[i] = dataclasses.replace(lines[i], reason=f"{lines[i].reason}; {text}")
    return Plan(total=total, kv_bytes=budget, kv_tokens=tokens, kv_cost=kv_cost, workspace_tokens=ws.tokens,
                fraction=float(fraction), world_size=world, lines=lines, steps=steps, title=title)
