"""`torch-budget`: the command line (`torch-budget <command> ...` or `python -m torch_budget ...`).

All command-line parsing lives here; each command then calls the module that owns its subject.
`torch-budget --help` stays cheap: torch is imported by the command that needs it.
Exit codes: 0 success, 1 the command ran and failed (an over-committed plan included), 2 bad
input (a message, never a traceback).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

from torch_budget.units import GiB, format_bytes, memory_bytes, parse_size

PROG = "torch-budget"

USAGE = f"""usage: {PROG} <command> [options]

commands:
  doctor   versions, devices, settings from TORCH_BUDGET_CONF, and the route install() would choose
  demo     serve the built-in model inside a planned budget; compare plan and measurement
  plan     plan a card's budgets for a described model (no GPU needed)
  report   render a plan or ledger JSON as a table and a PNG
  bench    run the allocator benchmark (tools/bench_alloc.py in a source checkout)
  replay   replay an allocation trace under torch's allocators and torch_budget's routes, side by side

`{PROG} <command> --help` describes a command's options."""


# --- argument types -------------------------------------------------------------------------------


def whole_number(text: str) -> int:
    """argparse type: a whole number."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """argparse type: a positive whole number."""
    value = whole_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def _memory(text: str, *, zero: bool, bare_gib: bool) -> int:
    """Bytes of device memory: a size with a unit (torch_budget.units.memory_bytes: a bare number
    is bytes only from 1 MiB up), or with `bare_gib` a bare number of GiB (the older *-gib flags).
    One rule for the sign: more than 0, or 0 too with `zero`."""
    try:
        number, unit = parse_size(text, "")
        if number < 0 or (number == 0 and not zero):
            raise ValueError(f"must be {'0 or more' if zero else 'more than 0'}, got {text!r}")
        if bare_gib and unit == "":
            return int(number * GiB)
        return memory_bytes(text, "", zero=zero)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size(text: str) -> int:
    """argparse type: bytes of memory, more than 0, written with a unit ("80GiB")."""
    return _memory(text, zero=False, bare_gib=False)


def size_or_zero(text: str) -> int:
    """argparse type: bytes of memory, 0 or more, written with a unit ("2GiB")."""
    return _memory(text, zero=True, bare_gib=False)


def gib(text: str) -> int:
    """argparse type of the older *-gib flags: a number of GiB, or a size with a unit; more than 0."""
    return _memory(text, zero=False, bare_gib=True)


def gib_or_zero(text: str) -> int:
    """argparse type of the older *-gib flags: as `gib`, 0 allowed."""
    return _memory(text, zero=True, bare_gib=True)


def output_file(text: str) -> Path:
    """argparse type: a file the command will write. One rule for every output of the command
    line: its folder must exist (nothing is created), and it must not be a folder itself;
    checked when the arguments are read, before any work."""
    path = Path(text)
    problem = output_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def output_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a new or replaced file, or None."""
    if path.is_dir():
        return f"{str(path)!r} is a folder; give a file path, e.g. {str(path / 'out.json')!r}"
    folder = path.parent
    if not folder.exists():
        return f"the folder {str(folder)!r} does not exist; create it first (no folder is created)"
    if not folder.is_dir():
        return f"{str(folder)!r} is a file, not a folder, so {str(path)!r} cannot be written"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{str(path)!r} cannot be written here: permission denied"
    return None


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    """(namespace, None), or (None, exit code) when parsing ended the command (--help, bad input)."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as e:
        return None, int(e.code or 0)


# --- doctor ---------------------------------------------------------------------------------------


def environment_settings(command: str):
    """(TORCH_BUDGET_CONF parsed, None), or (None, 2) once the error is printed: a command that
    install() would read the variable for stops on an invalid one, naming what is wrong once."""
    from torch_budget import config

    try:
        return config.from_environment(), None
    except (ValueError, TypeError) as e:
        print(f"{PROG} {command}: {e}", file=sys.stderr)
        return None, 2


def doctor_text(settings: dict) -> str:
    """Versions, the settings install() would use (`settings`: TORCH_BUDGET_CONF parsed), each
    device's capabilities and the route install() would choose there."""
    import platform

    from torch_budget import _native, config

    lines = [f"python        {platform.python_version()}"]
    conf = os.environ.get(config.ENV_VAR)
    source = f"{config.ENV_VAR}={conf!r}" if conf else f"{config.ENV_VAR} not set"
    lines.append(f"settings      {source}; install() arguments override these")
    described = config.describe(settings)
    width = max(len(key) for key, _ in described)
    lines += [f"  {key:<{width}}  {value}" for key, value in described]
    try:
        import torch
    except ImportError:
        return "\n".join(lines + ["torch         not installed"])
    lines.append(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})")
    built = _native.is_built("_C")
    lines.append(f"extension     {'built' if built else 'not built (pip install --no-build-isolation -e .)'}")
    if not torch.cuda.is_available():
        lines.append("devices       none visible: install() needs a CUDA device")
        return "\n".join(lines)
    if not built:
        return "\n".join(lines)
    from torch_budget import allocator

    lib = _native.load()
    n = lib.tb_device_count()
    if n < 0:
        lines.append(f"driver        {_native.error(lib)}")
        return "\n".join(lines)
    for i in range(n):
        caps = allocator.capabilities(i)
        lines.append(
            f"device {i}      {torch.cuda.get_device_name(i)}: {caps['total_bytes'] / GiB:.1f} GiB, "
            f"VMM {'yes' if caps['vmm'] else 'no'} (granularity {caps['granularity'] >> 20} MiB), "
            f"memory pools {'yes' if caps['pools'] else 'no'}; install() route: {allocator.route_for('vmm', i)}")
    return "\n".join(lines)


def _doctor_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROG} doctor", description=(
        "Print versions, the settings torch_budget.install() would use (TORCH_BUDGET_CONF parsed, and the "
        "default of every key it does not set), the visible devices, their capabilities and the route install() "
        "would choose. Exits 2 when TORCH_BUDGET_CONF is invalid, saying what is wrong."))


def _doctor(argv: list[str]) -> int:
    _, rc = _parse(_doctor_parser(), argv)
    if rc is not None:
        return rc
    settings, rc = environment_settings("doctor")
    if rc is not None:
        return rc
    from torch_budget import _native

    try:
        print(doctor_text(settings))
    except (OSError, _native.TorchBudgetError) as e:
        # OSError: the extension exists but cannot be loaded, e.g. built against another torch.
        print(f"{PROG} doctor: the compiled extension could not answer: {e}", file=sys.stderr)
        return 1
    return 0


# --- demo -----------------------------------------------------------------------------------------


def _demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} demo",
        description="Serve the built-in model (random weights, nothing downloaded) inside a budget planned from "
                    "measurements, then compare the plan's predicted peak with the measured one and draw the "
                    "ledger. Without a CUDA device (or without the compiled extension) it prints the plan for an "
                    "assumed card and says why it stops there.")
    parser.add_argument("--requests", type=positive_int, help="requests to serve (default 48, 16 with --quick)")
    parser.add_argument("--seed", type=whole_number, default=0,
                        help="seed for weights, prompt lengths and tokens (default 0)")
    parser.add_argument("--out", type=output_file, default=Path("torch_budget_ledger.png"),
                        help="where to write the measured ledger picture; its folder must exist "
                             "(default: ./torch_budget_ledger.png)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests, fewer graphs, a smaller KV cap")
    parser.add_argument("--native", action="store_true",
                        help="serve on torch's own allocator instead of torch_budget's (for comparison)")
    parser.add_argument("--sleep", action="store_true",
                        help="a last step: release the weights, KV cache and graph memory (torch_budget.sleep), "
                             "restore them, and check that the same prompts give the same tokens (needs "
                             "torch_budget installed on a device with VMM; otherwise the step says why it is skipped)")
    return parser


def _demo(argv: list[str]) -> int:
    args, rc = _parse(_demo_parser(), argv)
    if rc is not None:
        return rc
    _, rc = environment_settings("demo")
    if rc is not None:
        return rc
    from torch_budget import demo

    return demo.run(demo.make_settings(quick=args.quick, requests=args.requests, seed=args.seed, out=args.out,
                                       native=args.native, sleep=args.sleep))


# --- plan -----------------------------------------------------------------------------------------

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


def _plan_parser() -> argparse.ArgumentParser:
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
    w.add_argument("--weights-gib", type=gib, dest="weights", metavar="GIB", help="--weights in GiB when no unit is given")
    d = p.add_argument_group("device and measurements")
    g = d.add_mutually_exclusive_group()
    g.add_argument("--gpu-mem", type=size, metavar="SIZE",
                   help=f"card size, e.g. 80GiB or 141GB (default: the visible CUDA device's, else {assumed})")
    g.add_argument("--gpu-mem-gib", type=gib, dest="gpu_mem", metavar="GIB", help="--gpu-mem in GiB when no unit is given")
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
    s.add_argument("--max-batch", type=positive_int, metavar="N", default=256, help="sequences per step (default 256)")
    s.add_argument("--max-num-tokens", type=positive_int, metavar="N", default=8192, help="tokens per step (default 8192)")
    s.add_argument("--kv-shards", type=positive_int, metavar="N", default=1,
                   help="ranks each token's KV is split over (tensor or context parallel): the plan is one rank's, "
                        "and KV bytes per token are divided by this; weights and activations are not (default 1)")
    s.add_argument("--workspace-bytes-per-token", type=positive_int, metavar="N",
                   help="attention workspace bytes per attended token, reserved from the KV budget; needs "
                        "--max-seq-len for a described model (default: none)")
    s.add_argument("--attended-token-cap", type=positive_int, metavar="N",
                   help="cap on tokens attended per step, with --workspace-bytes-per-token "
                        "(default: min(--max-batch, --max-num-tokens) x --max-seq-len)")
    s.add_argument("--max-kv-tokens", type=positive_int, metavar="N", help="hard cap on KV tokens, only lowers the budget "
                                                              "(default: no cap)")
    k = s.add_mutually_exclusive_group()
    k.add_argument("--max-kv", type=size, metavar="SIZE", help="hard cap on KV bytes, only lowers the budget "
                                                               "(default: no cap)")
    k.add_argument("--max-kv-gib", type=gib, dest="max_kv", metavar="GIB", help="--max-kv in GiB when no unit is given")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="also write the plan as JSON, input for `torch-budget report`; its folder must exist "
                        "(default: not written)")
    return p


def _config_values(path: str) -> dict:
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"config file {path!r} is a folder; give the JSON file in it") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid JSON: {e}") from None
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


def _plan(argv: list[str]) -> int:
    args, rc = _parse(_plan_parser(), argv)
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
    return 0


# --- report ---------------------------------------------------------------------------------------


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROG} report",
                                     description="Render a plan or ledger JSON as a table and a PNG.")
    parser.add_argument("ledger", help="JSON written by `torch-budget plan --json` or Plan.to_json()")
    parser.add_argument("--out", type=output_file,
                        help="PNG path; its folder must exist (default: the ledger path with .png)")
    parser.add_argument("--title", help="title for the table and the picture (default: the ledger's own)")
    return parser


def _report(argv: list[str]) -> int:
    args, rc = _parse(_report_parser(), argv)
    if rc is not None:
        return rc
    from torch_budget.report import format_table, load_ledger, write_png

    out = args.out or Path(args.ledger).with_suffix(".png")
    try:
        title, total, lines = load_ledger(args.ledger)
    except ValueError as e:
        print(f"{PROG} report: error: {e}", file=sys.stderr)
        return 2
    problem = output_problem(out)
    if problem:
        print(f"{PROG} report: error: the picture beside the ledger: {problem}; choose one with --out",
              file=sys.stderr)
        return 2
    title = args.title or title
    print(format_table(lines, total, title))
    try:
        write_png(lines, total, out, title)
    except ImportError as e:
        print(f"{PROG} report: the table is above; {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{PROG} report: cannot write {str(out)!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"picture written to {out}")
    return 0


# --- bench ----------------------------------------------------------------------------------------


def bench_script() -> Path:
    """Where the benchmark script sits in a source checkout (it is not part of the package)."""
    return Path(__file__).resolve().parent.parent / "tools" / "bench_alloc.py"


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} bench",
        description="Run the allocator benchmark: torch.empty + del round trips at 4 KiB, 1 MiB and 64 MiB and a "
                    "random-size churn trace, for torch's native allocator and each torch_budget route, "
                    "interleaved and repeated, side by side. Needs a CUDA device and a source checkout "
                    "(the script is tools/bench_alloc.py).")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="interleaved rounds per configuration; the table shows medians (default 3)")
    return parser


def _bench(argv: list[str]) -> int:
    args, rc = _parse(_bench_parser(), argv)
    if rc is not None:
        return rc
    script = bench_script()
    if not script.is_file():
        print(f"{PROG} bench: no benchmark script at {script}. The benchmarks live in tools/bench_alloc.py of "
              "the torch_budget source repository; run this command from a source checkout "
              "(pip install --no-build-isolation -e .) or run that script directly.", file=sys.stderr)
        return 1
    # Its own process: benchmarks install the allocator, which must happen before CUDA starts.
    env = dict(os.environ, BENCH_ALLOC_ROUNDS=str(args.rounds))
    return subprocess.call([sys.executable, str(script)], cwd=script.parent.parent, env=env)


# --- replay ---------------------------------------------------------------------------------------


def _replay_parser() -> argparse.ArgumentParser:
    from torch_budget.replay.configs import CONFIGS, DEFAULT
    from torch_budget.replay.mixes import MIXES

    parser = argparse.ArgumentParser(
        prog=f"{PROG} replay",
        description="Replay allocation traces under torch's native allocator, its expandable segments, "
                    "cudaMallocAsync and torch_budget's routes, each in its own process, in interleaved rounds; "
                    "print time per operation (a paired ratio against native) and peak reserved over peak live "
                    "bytes side by side. A trace is a memory-history pickle from "
                    "torch.cuda.memory._dump_snapshot(), a torch_budget trace (.tbtrace[.gz]), or "
                    f"mix:<name> for a built-in mix ({', '.join(MIXES)}, or a size such as mix:1MiB).")
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="a memory-history pickle, a .tbtrace[.gz] file, or mix:<name>")
    parser.add_argument("--configs", default=",".join(DEFAULT),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all; native is always run)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--passes", type=positive_int, default=3,
                        help="replays of the trace in each process, each timed (default 3)")
    parser.add_argument("--pinning", choices=("pinned", "unpinned", "both"), default="pinned",
                        help="run each process on one CPU core beside the GPU, unpinned, or both (default pinned)")
    parser.add_argument("--touch", action="store_true", help="write the first byte of every tensor (launches a kernel "
                                                             "per allocation)")
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write every round's figures here; its folder must exist (default: not written)")
    return parser


def _replay(argv: list[str]) -> int:
    args, rc = _parse(_replay_parser(), argv)
    if rc is not None:
        return rc
    from torch_budget.replay import compare
    from torch_budget.replay.child import read_trace
    from torch_budget.replay.configs import CONFIGS
    from torch_budget.replay.trace import TraceError

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"{PROG} replay: unknown configuration {unknown[0]!r}: choose from {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    for spec in args.traces:
        try:
            t = read_trace(spec)
        except TraceError as e:
            print(f"{PROG} replay: {e}", file=sys.stderr)
            return 2
        print(f"{spec}: {len(t)} operations, {t.allocations()} allocations on {t.num_streams} stream(s), "
              f"peak live {format_bytes(t.peak_live())}", file=sys.stderr)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        why = "torch is not installed" if torch is None else "no CUDA device is visible"
        print(f"{PROG} replay: the traces above read correctly, but replaying them needs a GPU and {why}.",
              file=sys.stderr)
        return 1
    pinning = {"pinned": (True,), "unpinned": (False,), "both": (True, False)}[args.pinning]
    runs = compare.compare(args.traces, configs, args.rounds, pinning, args.passes, args.touch,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    rows = compare.summarise(runs)
    print(compare.table(rows))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({"rows": rows, "runs": [r.__dict__ for r in runs]}, indent=1))
        except OSError as e:
            print(f"{PROG} replay: cannot write {str(args.json)!r}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 1 if any(r["errors"] for r in rows) else 0


COMMANDS = {"doctor": _doctor, "demo": _demo, "plan": _plan, "report": _report, "bench": _bench,
            "replay": _replay}
PARSERS = {"doctor": _doctor_parser, "demo": _demo_parser, "plan": _plan_parser, "report": _report_parser,
           "bench": _bench_parser, "replay": _replay_parser}


def main(argv=None) -> int:
    """Run one `torch-budget` command and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if command == "--version":
        from torch_budget import __version__

        print(f"{PROG} {__version__}")
        return 0
    handler = COMMANDS.get(command)
    if handler is None:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{PROG}: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return int(handler(rest) or 0)
    except KeyboardInterrupt:
        print(f"\n{PROG} {command}: interrupted", file=sys.stderr)
        return 130
