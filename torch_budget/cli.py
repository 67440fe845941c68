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
import math
import os
import subprocess
import sys
from pathlib import Path

from torch_budget.units import GiB, format_bytes

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


def _float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def gib(text: str) -> float:
    """argparse type: a non-negative number of GiB."""
    value = _float(text, "a number of GiB")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-negative number of GiB")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _float(text, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


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
    parser.add_argument("--seed", type=whole_number, default=0, help="seed for weights, prompt lengths and tokens")
    parser.add_argument("--out", type=Path, default=Path("torch_budget_ledger.png"),
                        help="where to write the measured ledger picture (default: ./torch_budget_ledger.png)")
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

_MODEL_FLAGS = {
    "layers": "transformer layers",
    "hidden": "hidden size",
    "heads": "query heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "head_dim": "size of one head",
    "vocab": "vocabulary size",
    "max_seq_len": "longest sequence a request may hold",
    "dtype": "float32, float16 or bfloat16",
    "intermediate": "MLP width (default 4 * hidden)",
}


def _plan_parser() -> argparse.ArgumentParser:
    from torch_budget.planner import ASSUMED_CARD, ASSUMED_CARD_GIB

    p = argparse.ArgumentParser(
        prog=f"{PROG} plan",
        description="Plan a card's budgets for a described model without touching a GPU. Without model flags the "
                    "built-in demo model is planned; without --gpu-mem-gib the visible CUDA device's size is used, "
                    f"and without a device an assumed {ASSUMED_CARD} ({ASSUMED_CARD_GIB:g} GiB), said so in the "
                    "output. Exits 1 when the plan over-commits the card.")
    m = p.add_argument_group("model (flags override --config)")
    m.add_argument("--config", help="JSON file with model keys: " + ", ".join(_MODEL_FLAGS))
    for name, text in _MODEL_FLAGS.items():
        if name == "dtype":
            m.add_argument("--dtype", help=text)
        else:
            m.add_argument("--" + name.replace("_", "-"), type=positive_int, dest=name, help=text)
    m.add_argument("--weights-gib", type=gib, help="weight bytes of a real checkpoint (default: computed from the shape)")
    d = p.add_argument_group("device and measurements")
    d.add_argument("--gpu-mem-gib", type=gib, help="card size in GiB (default: the visible CUDA device's, else "
                                                   f"an assumed {ASSUMED_CARD})")
    d.add_argument("--activation-gib", type=gib,
                   help="measured activation peak (default: estimated from the model's shapes)")
    d.add_argument("--non-torch-gib", type=gib, default=0.0,
                   help="memory outside torch: context, NCCL (default 0, i.e. unknown)")
    s = p.add_argument_group("scheduler and caps")
    s.add_argument("--fraction", type=fraction, default=0.9,
                   help="share of what the peak leaves free that the KV cache may take (default 0.9)")
    s.add_argument("--max-batch", type=positive_int, default=256, help="sequences per step (default 256)")
    s.add_argument("--max-num-tokens", type=positive_int, default=8192, help="tokens per step (default 8192)")
    s.add_argument("--kv-shards", type=positive_int, default=1, help="tensor/context-parallel ways the KV is split")
    s.add_argument("--workspace-bytes-per-token", type=positive_int,
                   help="attention workspace bytes per attended token (reserved from the KV budget)")
    s.add_argument("--attended-token-cap", type=positive_int,
                   help="cap on tokens attended per step (default min(max batch, max tokens) * max_seq_len)")
    s.add_argument("--max-kv-tokens", type=positive_int, help="hard cap on KV tokens (only lowers the budget)")
    s.add_argument("--max-kv-gib", type=gib, help="hard cap on KV bytes, GiB (only lowers the budget)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (input for `torch-budget report`)")
    return p


def _model_config(args):
    from torch_budget.demo.settings import MODEL
    from torch_budget.planner.shape import ModelShape

    values: dict = {}
    if args.config:
        try:
            with open(args.config) as f:
                values = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {args.config!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {args.config!r} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"config file {args.config!r} must hold a JSON object")
    values.update({k: getattr(args, k) for k in _MODEL_FLAGS if getattr(args, k) is not None})
    if ModelShape.unknown(values):
        return ModelShape.from_dict(values)  # raises, naming the unknown keys
    # What is not given is the built-in model's, the MLP width 4 * hidden.
    values.setdefault("intermediate", 4 * values.get("hidden", MODEL.hidden))
    return ModelShape.from_dict({**MODEL.to_dict(), **values})


def _card_bytes(args) -> tuple[int, str]:
    from torch_budget.planner import ASSUMED_CARD, ASSUMED_CARD_GIB

    if args.gpu_mem_gib is not None:
        if args.gpu_mem_gib <= 0:
            raise ValueError(f"--gpu-mem-gib must be positive, got {args.gpu_mem_gib}")
        total = int(args.gpu_mem_gib * GiB)
        return total, f"card {format_bytes(total)} (--gpu-mem-gib)"
    import torch

    if torch.cuda.is_available():
        total = int(torch.cuda.mem_get_info()[1])
        return total, f"card {format_bytes(total)} ({torch.cuda.get_device_name()}, read from the device)"
    total = int(ASSUMED_CARD_GIB * GiB)
    print(f"no CUDA device here and no --gpu-mem-gib: planning for an assumed {ASSUMED_CARD} "
          f"({ASSUMED_CARD_GIB:g} GiB usable)")
    return total, f"assumed {ASSUMED_CARD} ({format_bytes(total)})"


def _plan(argv: list[str]) -> int:
    args, rc = _parse(_plan_parser(), argv)
    if rc is not None:
        return rc
    from torch_budget import planner
    from torch_budget.planner.shape import described_profile, kv_cache_cost

    try:
        cfg = _model_config(args)
        total, card = _card_bytes(args)
        seqs = min(args.max_batch, args.max_num_tokens)
        prof, notes = described_profile(
            cfg, total=total, num_tokens=args.max_num_tokens, num_sequences=seqs,
            weights=int(args.weights_gib * GiB) if args.weights_gib is not None else None,
            activations=int(args.activation_gib * GiB) if args.activation_gib is not None else None,
            non_torch=int(args.non_torch_gib * GiB))
        result = planner.plan(
            prof,
            kv_cache_cost(cfg).shard(args.kv_shards),
            fraction=args.fraction,
            workspace_bytes_per_token=args.workspace_bytes_per_token or 0,
            max_batch=args.max_batch,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=cfg.max_seq_len,
            attended_cap=args.attended_token_cap,
            max_kv_bytes=int(args.max_kv_gib * GiB) if args.max_kv_gib is not None else None,
            max_kv_tokens=args.max_kv_tokens,
            notes=notes,
            title=f"plan: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads, "
                  f"{cfg.dtype}, {card}",
        )
        print(result.to_text())
        if args.json:
            with open(args.json, "w") as f:
                f.write(result.to_json())
            print(f"plan written to {args.json}")
    except (ValueError, TypeError, OSError) as e:
        print(f"{PROG} plan: error: {e}", file=sys.stderr)
        return 2
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
    parser.add_argument("--out", help="PNG path (default: the ledger path with .png)")
    parser.add_argument("--title", help="title for the table and the picture")
    return parser


def _report(argv: list[str]) -> int:
    args, rc = _parse(_report_parser(), argv)
    if rc is not None:
        return rc
    from torch_budget.report import format_table, load_ledger, write_png

    try:
        title, total, lines = load_ledger(args.ledger)
        title = args.title or title
        out = Path(args.out) if args.out else Path(args.ledger).with_suffix(".png")
        print(format_table(lines, total, title))
        write_png(lines, total, out, title)
    except ImportError as e:
        print(f"{PROG} report: the table is above; the picture needs matplotlib: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"{PROG} report: error: {e}", file=sys.stderr)
        return 2
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
    parser.add_argument("--json", metavar="PATH", help="also write every round's figures here")
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
            print(f"{PROG} replay: cannot write {args.json}: {e.strerror}", file=sys.stderr)
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
