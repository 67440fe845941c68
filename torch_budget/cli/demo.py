"""`torch-budget demo`: its options; the demo itself is torch_budget.demo."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch_budget.cli.arguments import PROG, output_file, parse, positive_int, seed
from torch_budget.cli.doctor import environment_settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} demo",
        description="Serve the built-in model (random weights, nothing downloaded) inside a budget planned from "
                    "measurements, then compare the plan's predicted peak with the measured one and draw the "
                    "ledger. Without a CUDA device (or without the compiled extension) it prints the plan for an "
                    "assumed card and says why it stops there.")
    p.add_argument("--requests", type=positive_int, help="requests to serve (default 48, 16 with --quick)")
    p.add_argument("--seed", type=seed, default=0,
                   help="seed for weights, prompt lengths and tokens (default 0)")
    p.add_argument("--out", type=output_file, default=Path("torch_budget_ledger.png"),
                   help="where to write the measured ledger picture; its folder must exist "
                        "(default: ./torch_budget_ledger.png)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests, fewer graphs, a smaller KV cap")
    p.add_argument("--native", action="store_true",
                   help="serve on torch's own allocator instead of torch_budget's (for comparison)")
    p.add_argument("--sleep", action="store_true",
                   help="a last step: release the weights, KV cache and graph memory (torch_budget.sleep), "
                        "restore them, and check that the same prompts give the same tokens (needs "
                        "torch_budget installed on a device with VMM; otherwise the step says why it is skipped)")
    return p


def run(argv: list[str]) -> int:
    args, rc = parse(parser(), argv)
    if rc is not None:
        return rc
    _, rc = environment_settings("demo")
    if rc is not None:
        return rc
    from torch_budget import demo

    return demo.run(demo.make_settings(quick=args.quick, requests=args.requests, seed=args.seed, out=args.out,
                                       native=args.native, sleep=args.sleep))
