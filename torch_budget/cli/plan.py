"""`torch-budget plan`: a card's budgets for a model described by its shape, without a GPU."""

from __future__ import annotations

import argparse
import sys

from torch_budget._validate import read_json_file
from torch_budget.cli.arguments import (PROG, fraction, gib, gib_or_zero, output_file, parse, positive_int, size,
                                         size_or_zero)
from torch_budget.units import GiB, format_bytes


_SHAPE_HELP = {
    "layers": "transformer layers",
    "hidden": "hidden size",
    "heads": "query heads",
    "kv_heads": "key/value heads (fewer than --heads under grouped-query attention)",
    "intermediate": "MLP width (each of the gated MLP's three matrices is hidden x intermediate)",
    "vocab": "vocabulary size",
}
_SETTING_KEYS = ("head_dim", "max_seq_len", "dtype")


def _flags(keys) -> str:
    return ", ".join("--" + k.replace("_", "-") for k in keys)


def parser() -> argparse.ArgumentParser:
    from torch_budget.planner import ASSUMED_CARD, ASSUMED_CARD_GIB
    from torch_budget.planner.shape import DTYPE_BYTES, SHAPE_FIELDS

    assumed = f"an assumed {ASSUMED_CARD} of {ASSUMED_CARD_GIB:g} GiB"
    p = argparse.ArgumentParser(
        prog=f"{PROG} plan",
        description="Plan a card's budgets for a described model without touching a GPU. A model is its shape: "
                    f"all of {_flags(SHAPE_FIELDS)} (flags, or keys of a --config file); with none of them the "
                    "built-in demo model is planned. Sizes take a unit (80GiB, 512MiB, 141GB); a bare number is "
                    "bytes only from 1 MiB up. Output files go into folders that exist; none is created. Exits 1 "
                    "when the plan over-commits the card, 2 on bad input.")
    m = p.add_argument_group("model shape: all of these or none (flags override --config)")
    m.add_argument("--config", metavar="PATH", help="JSON object with any of the model keys " +
                   ", ".join([*SHAPE_FIELDS, *_SETTING_KEYS]) + " (default: none)")
    for name in SHAPE_FIELDS:
        m.add_argument("--" + name.replace("_", "-"), type=positive_int, dest=name, metavar="N",
                       help=f"{_SHAPE_HELP[name]} (no default: part of the shape)")
    o = p.add_argument_group("model settings")
    o.add_argument("--head-dim", type=positive_int, metavar="N", help="size of one head (default: --hidden / --heads)")
    o.add_argument("--max-seq-len", type=positive_int, metavar="N",
                   help="longest sequence one request may hold; needed by --workspace-bytes-per-token (default: "
                        "not stated for a described model, 2048 for the built-in one)")
    o.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="dtype of weights and KV cache (default bfloat16)")
    w = o.add_mutually_exclusive_group()
    w.add_argument("--weights", type=size, metavar="SIZE",
                   help="weight bytes of a real checkpoint, or of one rank's share under tensor parallelism "
                        "(default: parameters x dtype bytes, computed from the shape)")
    w.add_argument("--weights-gib", type=gib, dest="weights", metavar="GIB",
                   help="--weights in GiB when no unit is given")
    d = p.add_argument_group("device and measurements")
    g = d.add_mutually_exclusive_group()
    g.add_argument("--gpu-mem", type=size, metavar="SIZE",
                   help=f"card size, e.g. 80GiB or 141GB (default: the visible CUDA device's, else {assumed})")
    g.add_argument("--gpu-mem-gib", type=gib, dest="gpu_mem", metavar="GIB",
                   help="--gpu-mem in GiB when no unit is given")
    a = d.add_mutually_exclusive_group()
    a.add_argument("--activations", type=size, metavar="SIZE",
                   help="measured activation peak of one step (default: estimated from the shape for one step of "
                        "--max-num-tokens tokens in min(--max-batch, --max-num-tokens) sequences)")
    a.add_argument("--activation-gib", type=gib, dest="activations", metavar="GIB",
                   help="--activations in GiB when no unit is given")
    n = d.add_mutually_exclusive_group()
    n.add_argument("--non-torch", type=size_or_zero, default=0, metavar="SIZE",
                   help="memory outside torch: context, NCCL (default 0, i.e. unknown)")
    n.add_argument("--non-torch-gib", type=gib_or_zero, dest="non_torch", metavar="GIB",
                   help="--non-torch in GiB when no unit is given")
    s = p.add_argument_group("scheduler and caps")
    s.add_argument("--fraction", type=fraction, default=0.9,
                   help="share of what the peak leaves free that the KV cache may take (default 0.9)")
    s.add_argument("--max-batch", type=positive_int, metavar="N", default=256,
                   help="sequences per step (default 256)")
    s.add_argument("--max-num-tokens", type=positive_int, metavar="N", default=8192,
                   help="tokens per step (default 8192)")
    s.add_argument("--kv-shards", type=positive_int, metavar="N", default=1,
                   help="ranks each token's KV is split over (tensor or context parallel): the plan is one rank's, "
                        "and KV bytes per token are divided by this; weights and activations are not (default 1)")
    s.add_argument("--workspace-bytes-per-token", type=positive_int, metavar="N",
                   help="attention workspace bytes per attended token, reserved from the KV budget; needs "
                        "--max-seq-len for a described model (default: none)")
    s.add_argument("--attended-token-cap", type=positive_int, metavar="N",
                   help="cap on tokens attended per step, with --workspace-bytes-per-token "
                        "(default: min(--max-batch, --max-num-tokens) x --max-seq-len)")
    s.add_argument("--max-kv-tokens", type=positive_int, metavar="N",
                   help="hard cap on KV tokens, only lowers the budget (default: no cap)")
    k = s.add_mutually_exclusive_group()
    k.add_argument("--max-kv", type=size, metavar="SIZE", help="hard cap on KV bytes, only lowers the budget "
                                                               "(default: no cap)")
    k.add_argument("--max-kv-gib", type=gib, dest="max_kv", metavar="GIB", help="--max-kv in GiB when no unit is given")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="also write the plan as JSON, input for `torch-budget report`; its folder must exist "
                        "(default: not written)")
    return p


def _config_values(path: str) -> dict:
    values = read_json_file(path, "config file")
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a JSON object")
    return values


def model_shape(args):
    """(ModelShape, what it is) from --config and the model flags: the built-in demo model when
    no shape field is given, else a shape that must be whole (only head_dim may be derived)."""
    import dataclasses

    from torch_budget.demo.settings import MODEL
    from torch_budget.planner.shape import SHAPE_FIELDS, ModelShape

    values = _config_values(args.config) if args.config else {}
    unknown = ModelShape.unknown(values)
    if unknown:
        raise ValueError(f"config file {args.config!r} has unknown key(s) {unknown}; known keys are "
                         f"{', '.join([*SHAPE_FIELDS, *_SETTING_KEYS])}")
    values.update({k: getattr(args, k) for k in (*SHAPE_FIELDS, *_SETTING_KEYS) if getattr(args, k) is not None})
    given = [k for k in (*SHAPE_FIELDS, "head_dim") if values.get(k) is not None]
    if not given:
        settings = {k: values[k] for k in ("max_seq_len", "dtype") if values.get(k) is not None}
        return dataclasses.replace(MODEL, **settings), "the built-in demo model"
    missing = ModelShape.missing(values)
    if missing:
        raise ValueError(f"a model shape needs all of {_flags(SHAPE_FIELDS)}; {_flags(given)} given, "
                         f"{_flags(missing)} missing (or give none of them to plan the built-in demo model)")
    return ModelShape.from_dict(values), "described model"


def _card_bytes(args) -> tuple[int, str]:
    from torch_budget.planner import ASSUMED_CARD, ASSUMED_CARD_GIB

    if args.gpu_mem is not None:
        return args.gpu_mem, f"card {format_bytes(args.gpu_mem)} (--gpu-mem)"
    import torch

    if torch.cuda.is_available():
        total = int(torch.cuda.mem_get_info()[1])
        return total, f"card {format_bytes(total)} ({torch.cuda.get_device_name()}, read from the device)"
    total = int(ASSUMED_CARD_GIB * GiB)
    print(f"no CUDA device here and no --gpu-mem: planning for an assumed {ASSUMED_CARD} "
          f"({ASSUMED_CARD_GIB:g} GiB usable)")
    return total, f"assumed {ASSUMED_CARD} ({format_bytes(total)})"


def _shard_notes(ways: int, shape, weights_given: bool) -> dict:
    """What --kv-shards means for the ledger lines it touches."""
    kv = f"one rank's share: each token's KV split {ways} ways (--kv-shards)"
    if ways > shape.kv_heads:
        kv += (f"; {ways} ways over {shape.kv_heads} KV heads holds when tokens are split (context parallel), "
               f"not under tensor parallelism, which replicates KV heads: plan that with --kv-shards {shape.kv_heads}")
    notes = {"KV pool": kv}
    if not weights_given:
        notes["weights"] = "the whole model's: under tensor parallelism give one rank's share with --weights"
    return notes


def run(argv: list[str]) -> int:
    args, rc = parse(parser(), argv)
    if rc is not None:
        return rc
    from torch_budget import planner
    from torch_budget.planner.shape import described_profile, kv_cache_cost

    try:
        shape, which = model_shape(args)
        if args.workspace_bytes_per_token and shape.max_seq_len is None:
            raise ValueError("--workspace-bytes-per-token needs --max-seq-len: the workspace's attended tokens are "
                             "bounded by min(--max-batch, --max-num-tokens) x the longest sequence")
        if args.attended_token_cap is not None and not args.workspace_bytes_per_token:
            raise ValueError("--attended-token-cap caps the per-token workspace, so it needs "
                             "--workspace-bytes-per-token")
        total, card = _card_bytes(args)
        prof, notes = described_profile(
            shape, total=total, num_tokens=args.max_num_tokens, num_sequences=min(args.max_batch, args.max_num_tokens),
            weights=args.weights, activations=args.activations, non_torch=args.non_torch)
        if args.kv_shards > 1:
            for line, text in _shard_notes(args.kv_shards, shape, args.weights is not None).items():
                notes[line] = f"{notes[line]}; {text}" if line in notes else text
        result = planner.plan(
            prof,
            kv_cache_cost(shape).shard(args.kv_shards),
            fraction=args.fraction,
            workspace_bytes_per_token=args.workspace_bytes_per_token or 0,
            max_batch=args.max_batch,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=shape.max_seq_len,
            attended_cap=args.attended_token_cap,
            max_kv_bytes=args.max_kv,
            max_kv_tokens=args.max_kv_tokens,
            kv_shards=args.kv_shards,
            notes=notes,
            title=f"plan: {which}, {shape.layers} layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} "
                  f"heads of {shape.head_dim}, {shape.dtype}, {card}",
        )
    except (ValueError, TypeError) as e:
        print(f"{PROG} plan: error: {e}", file=sys.stderr)
        return 2
    print(result.to_text())
    if args.json:
        try:
            args.json.write_text(result.to_json())
        except OSError as e:
            print(f"{PROG} plan: cannot write {str(args.json)!r}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"plan written to {args.json}")
    headroom = result.line("headroom").bytes
    if headroom < 0:
        print(f"{PROG} plan: the card is over-committed by {format_bytes(-headroom)}: the peak and the reserves "
              "do not fit", file=sys.stderr)
        return 1
    # As serving engines refuse to start when their KV cache cannot hold one request of the longest length.
    longest = shape.max_seq_len or result.kv_cost.max_tokens_per_request
    if longest and result.kv_tokens < longest:
        caps = [flag for flag, value in (("--max-kv", args.max_kv), ("--max-kv-tokens", args.max_kv_tokens))
                if value is not None]
        fix = (f"raise {' or '.join(caps)} (the cap you gave) or give a shorter --max-seq-len" if caps else
               "give more memory, a shorter --max-seq-len, fewer reserves or a smaller workspace")
        print(f"{PROG} plan: the KV pool holds {result.kv_tokens} tokens, fewer than one request of the longest "
              f"length ({longest} tokens): nothing that long could be served; {fix}", file=sys.stderr)
        return 1
    return 0
