"""The plan of one card: the seven steps from a profile to a KV budget (`plan`), and the
`Plan` they produce, whose ledger explains every byte of the card."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Sequence

from torch_budget._validate import INT64_MAX, fraction as _fraction, integer, non_negative_int, number
from torch_budget.errors import InvalidArgumentError
import torch_budget.planner.apply as _apply
from torch_budget.planner.costs import CacheCost, Reserve, WorkspaceReserve, attended_token_cap, workspace_reserve
from torch_budget.planner.ledger import LedgerLine, format_table
from torch_budget.planner.measure import Profile
from torch_budget.units import format_bytes


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
    kv_shards: int = 1  # ranks each token's KV is split over; the plan is one rank's

    def line(self, name: str) -> LedgerLine:
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(f"plan has no ledger line {name!r}; lines are {[l.name for l in self.lines]}")

    def bytes_in(self, category: str) -> int:
        return sum(line.bytes for line in self.lines if line.category == category)

    def tag_budgets(self, tags: dict[str, str] | None = None) -> dict[str, int]:
        """{tag: bytes}: the plan's lines as per-tag budgets (Note [Plan as budgets] in
        planner/apply.py; `tags` maps a ledger category to its tag, planner.apply.TAGS by
        default). Before install(): `torch_budget.install(budgets=plan.budget_settings())`."""
        return _apply.tag_budgets(self.lines, tags)

    def budget_settings(self, tags: dict[str, str] | None = None) -> dict[str, tuple]:
        """tag_budgets() as install(budgets=...) takes them whatever their size ({tag: ("bytes",
        n)}: a bare number under 1 MiB would be refused as a likely slip for a fraction). install()
        cannot check that they fit a device (none exists yet): apply() checks that, and sets the
        same budgets again."""
        return {tag: _apply.as_setting(n) for tag, n in self.tag_budgets(tags).items()}

    def apply(self, device=None, tags: dict[str, str] | None = None) -> "_apply.AppliedBudgets":
        """Enforce the plan: set each tag's budget to its lines (tag_budgets) through
        torch_budget.set_budget, on `device` (None: the current one; "all": every device), inside
        the device's budget, over a plan applied there before, whose budgets its undo() brings back
        (Note [Plans in force on a device], planner/apply.py). Raises PlanDoesNotFitError, setting nothing, when the budgets
        in force would add up to more than the device's budget (the card less the plan's non-torch
        lines when none is set; budgets of tags the plan does not name count too) or give a tag
        less than it has allocated. Returns what was set, with the budgets it replaced: `.undo()`
        (or a `with` block) puts those back."""
        return _apply.apply(self.tag_budgets(tags), outside_torch=self.bytes_in("non_torch"),
                            planned_total=self.total, device=device)

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
        if not isinstance(d, dict):
            raise ValueError(f"a plan is a JSON object (Plan.to_json()), got {type(d).__name__}")
        d = dict(d)
        if d.pop("kind", "torch_budget.plan") != "torch_budget.plan":
            raise ValueError("not a torch_budget plan")
        fields = {f.name for f in dataclasses.fields(cls)}
        needed = {f.name for f in dataclasses.fields(cls)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, unknown = sorted(needed - d.keys()), sorted(d.keys() - fields)
        if missing or unknown:
            raise ValueError("not a torch_budget plan: " + "; ".join(
                ([f"it lacks {', '.join(map(repr, missing))}"] if missing else [])
                + ([f"unknown key(s) {', '.join(map(repr, unknown))}"] if unknown else [])))
        try:
            d["kv_cost"] = CacheCost.from_dict(d["kv_cost"])
            d["lines"] = [LedgerLine.from_dict(x) for x in d["lines"]]
            d["steps"] = [PlanStep(**x) for x in d["steps"]]
            for name in ("total", "kv_bytes", "kv_tokens", "workspace_tokens", "world_size", "kv_shards"):
                if name in d:
                    integer(d[name], f"the plan's {name}", minimum=1 if name in ("total", "world_size",
                                                                                 "kv_shards") else 0)
            number(d["fraction"], "the plan's fraction")
            plan = cls(**d)
        except (TypeError, AttributeError, KeyError, InvalidArgumentError) as e:
            raise ValueError(f"not a torch_budget plan: {e}") from None
        kv = [line for line in plan.lines if line.category == "kv_pool"]
        if len(kv) != 1 or kv[0].bytes != plan.kv_bytes:
            raise ValueError(f"not a torch_budget plan: it has {len(kv)} KV pool line(s) where a plan has one, "
                             "of its kv_bytes")
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _reserves(given, what: str) -> list[Reserve]:
    """`given` as a list of Reserve, or TypeError naming `what` and what it holds instead."""
    if isinstance(given, Reserve):
        raise TypeError(f"{what} is a list of Reserve; got one Reserve: write {what}=[{given!r}]")
    if isinstance(given, (str, bytes, dict)) or not hasattr(given, "__iter__"):
        raise TypeError(f"{what} is a list of Reserve, got {type(given).__name__} ({given!r})")
    out = list(given)
    for r in out:
        if not isinstance(r, Reserve):
            raise TypeError(f"{what} is a list of Reserve, and holds {type(r).__name__} ({r!r}): write "
                            f"Reserve(name, bytes, reason)")
    return out


def _min_over_ranks(values: list[int], group) -> tuple[list[int], int]:
    """All-reduce MIN of byte or token counts, in one collective, when torch.distributed is up;
    (values, 1) otherwise. Every rank calls it once per plan, whatever its own arguments."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values, 1
    # NCCL only reduces device tensors; every other backend takes host tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()], dist.get_world_size(group)


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
    kv_shards: int = 1,
    group=None,
    notes: dict[str, str] | None = None,
    title: str = "torch_budget plan",
) -> Plan:
    """Plan the KV budget of one card (every rank calls it when torch.distributed is up).

    Note [Planner steps]
    1-2. `profile` gives the peak, what the device held: torch's peak, the allocator's cache at it
       (torch reserved minus torch peak: memory the device holds though no tensor does) and what
       lives outside torch. The ledger has lines for all three (weights and activations split
       torch's peak), so what the device really held at the peak is what the KV budget is cut from.
    3. `beside_peak` reserves sit next to the peak: things the profiling forward did not hold
       (capacity-sized fixed workspaces, first-request-only increments, encoder outputs).
    4. `available = (total - peak + estimation_kv_bytes) * fraction`; KV memory that existed only
       so profiling could run is counted in the peak and is given back here.
    5. `from_kv` reserves come out of the KV budget: they appear after the KV pool exists (graph
       pools, late workspaces). A workspace that grows per attended token takes its share via
       `workspace_reserve` with L from `attended_token_cap`.
    6. Hard caps (`max_kv_bytes`, `max_kv_tokens` via `kv_cost`) can only lower the budget.
    7. Across ranks the budget is the min, exchanged in bytes: ranks may have different KV costs
       per token, but a byte budget means the same thing on every rank. `kv_shards` says how many
       ranks each token's KV is split over (`kv_cost` is then one rank's, see CacheCost.shard);
       it only explains: planned without a process group, the other ranks are assumed alike.
    A negative budget at any step is clamped to 0. What step 5's reserves take past the KV budget
    comes out of the 1-fraction margin (the headroom line's reason says how much); once that is
    gone too, the headroom line goes negative and shows by how much the card is over-committed.

    `notes` maps a ledger line name ("weights", "activations", "non-torch", "allocator cache") to
    text appended to its reason, e.g. where a figure came from when it was not measured.
    """
    if not isinstance(kv_cost, CacheCost):
        numeric = isinstance(kv_cost, (int, float)) and not isinstance(kv_cost, bool)
        hint = f": for {kv_cost!r} bytes per token write CacheCost(slope={kv_cost!r})" if numeric else ""
        raise TypeError(f"kv_cost must be a CacheCost, got {type(kv_cost).__name__}{hint}")
    _fraction(fraction, "fraction")
    beside_peak, from_kv = _reserves(beside_peak, "beside_peak"), _reserves(from_kv, "from_kv")
    estimation_kv_bytes = non_negative_int(estimation_kv_bytes, "estimation_kv_bytes")
    workspace_bytes_per_token = non_negative_int(workspace_bytes_per_token, "workspace_bytes_per_token")
    eager_workspace_in_peak = non_negative_int(eager_workspace_in_peak, "eager_workspace_in_peak")
    kv_shards = integer(kv_shards, "kv_shards", minimum=1)  # as ints: a numpy integer would reach the JSON
    if max_kv_bytes is not None:
        max_kv_bytes = non_negative_int(max_kv_bytes, "max_kv_bytes")
    if max_kv_tokens is not None:
        max_kv_tokens = non_negative_int(max_kv_tokens, "max_kv_tokens")
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
                          f"allocator cache {format_bytes(profile.allocator_cache)}, peak {format_bytes(profile.peak)}"))

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
    if taken > available:
        note += f", {format_bytes(taken - available)} more than is available: KV budget clamped to 0"
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
        cap_bytes = kv_cost.charged_for_tokens(max_kv_tokens)
        caps.append(f"max_kv_tokens {max_kv_tokens} = {format_bytes(cap_bytes)}")
        budget = min(budget, max(cap_bytes, 0))
    steps.append(PlanStep(6, "caps", budget, ", ".join(caps) if caps else "no caps"))

    # 7. min over ranks, in bytes
    capped = budget
    # One admission cap for all, in the same collective: a scheduler admitting up to its own rank's
    # cap would take another rank's workspace past its line. A rank without such a workspace
    # gives no cap (ranks may differ in it, and each must run the same collectives).
    (budget, fewest), world = _min_over_ranks([budget, ws.tokens if workspace_bytes_per_token > 0 else INT64_MAX],
                                              group)
    if world > 1 and workspace_bytes_per_token > 0 and fewest < ws.tokens:
        ws = WorkspaceReserve(fewest * workspace_bytes_per_token, fewest)
    if world > 1:
        ranks = f"min over {world} ranks"
    elif kv_shards > 1:
        ranks = (f"one of {kv_shards} ranks sharing each token's KV, planned alone: no process group to take the "
                 "min over, so every rank is assumed to have this card and this peak")
    else:
        ranks = "single rank"
    steps.append(PlanStep(7, "ranks", budget, ranks))

    tokens = kv_cost.tokens_for_tag_budget(budget)  # the KV line is the KV tag's budget
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
    lines.append(LedgerLine("allocator cache", "allocator_cache", profile.allocator_cache,
                            "allocator's cached memory at the profiled peak: torch reserved minus torch peak"))
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
    short = max(taken - available, 0)  # reserves past the KV budget take it from the margin
    if raw > 0 and raw - available > short:
        parts.append(f"1-fraction margin {format_bytes(raw - available - short)}")
    if uncapped > capped:
        parts.append(f"caps {format_bytes(uncapped - capped)}")
    if capped > budget:
        parts.append(f"min over ranks {format_bytes(capped - budget)}")
    why = "left unplanned: " + (", ".join(parts) if parts else "nothing")
    if short:
        why += (f"; the reserves taken from the KV budget exceed it by {format_bytes(short)}, taken from "
                f"the 1-fraction margin{' and the card' if short > raw - available else ''}")
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
                fraction=float(fraction), world_size=world, lines=lines, steps=steps, title=title,
                kv_shards=kv_shards)
