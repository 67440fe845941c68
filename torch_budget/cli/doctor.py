"""`torch-budget doctor`: versions, the settings install() would use, the devices and their routes."""

from __future__ import annotations

import argparse
import os
import sys

from torch_budget.cli.arguments import PROG, parse
from torch_budget.units import GiB


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
    from torch_budget import diagnostics

    lib = _native.load()
    n = lib.tb_device_count()
    if n < 0:
        lines.append(f"driver        {_native.error(lib)}")
        return "\n".join(lines)
    for i in range(n):
        caps = diagnostics.capabilities(i)
        lines.append(
            f"device {i}      {torch.cuda.get_device_name(i)}: {caps['total_bytes'] / GiB:.1f} GiB, "
            f"VMM {'yes' if caps['vmm'] else 'no'} (granularity {caps['granularity'] >> 20} MiB), "
            f"memory pools {'yes' if caps['pools'] else 'no'}; install() route: {diagnostics.route_for('vmm', i)}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROG} doctor", description=(
        "Print versions, the settings torch_budget.install() would use (TORCH_BUDGET_CONF parsed, and the "
        "default of every key it does not set), the visible devices, their capabilities and the route install() "
        "would choose. Exits 2 when TORCH_BUDGET_CONF is invalid, saying what is wrong."))


def run(argv: list[str]) -> int:
    _, rc = parse(parser(), argv)
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
