"""Serving a stack in every Python process it starts, from one environment variable.

    TORCH_BUDGET_SERVE=tensorrt_llm python serve.py

TensorRT-LLM runs its executor in worker processes of its own (MPI's, or Ray's), even for one GPU
unless TLLM_WORKER_USE_SINGLE_PROCESS=1; a call in the user's process never reaches them. The wheel
installs a startup file (torch_budget-startup.pth, which Python's site module reads at every
interpreter start) that calls run() when TORCH_BUDGET_SERVE is set, and does nothing else
otherwise. Every process started with the variable in its environment then:

  tensorrt_llm   installs torch_budget when tensorrt_llm is first imported (before TensorRT-LLM
                 starts CUDA; torch_budget.install() with TORCH_BUDGET_CONF's settings, without
                 starting the driver), and points tensorrt_llm._torch.virtual_memory at
                 torch_budget.adapters.tensorrt_llm as it loads (serve_tensorrt_llm()), so the
                 executor's scopes and LLM.sleep / LLM.wakeup are torch_budget's.

Values are comma-separated. An unknown value, or a failure while serving, is reported on stderr
with what to do; it never stops the interpreter from starting (the startup file runs in every
process of the environment, pip's and the shell's helpers included).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from typing import Optional

VARIABLE = "TORCH_BUDGET_SERVE"
STACKS = ("tensorrt_llm",)
_TRT_PACKAGE = "tensorrt_llm"
_TRT_MODULE = "tensorrt_llm._torch.virtual_memory"


def _say(message: str) -> None:
    print(f"torch_budget ({VARIABLE}): {message}", file=sys.stderr)


def parse(value: str) -> list[str]:
    """The stacks a TORCH_BUDGET_SERVE value names; ValueError naming what is unknown."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in STACKS]
    if unknown:
        raise ValueError(f"unknown value(s) {', '.join(map(repr, unknown))}: expected a comma-separated list of "
                         f"{', '.join(STACKS)}")
    return names


class _ServingLoader(importlib.abc.Loader):
    """A module's own loader, with `before` called before the module runs and `after` after it."""

    def __init__(self, loader, before=None, after=None):
        self._loader, self._before, self._after = loader, before, after

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if self._before is not None:
            self._before()
        self._loader.exec_module(module)
        if self._after is not None:
            self._after()


def _install_for_tensorrt_llm() -> None:
    try:
        import torch_budget.adapters.tensorrt_llm  # noqa: F401  (installs at import, as its module says)
    except Exception as e:
        _say(f"could not install torch_budget before TensorRT-LLM ({type(e).__name__}: {e})")


def _serve_tensorrt_llm() -> None:
    try:
        from torch_budget.adapters.tensorrt_llm import serve_tensorrt_llm

        serve_tensorrt_llm()
    except Exception as e:  # the stack keeps running on its own virtual memory, and is told so
        _say(f"could not serve TensorRT-LLM's virtual memory ({type(e).__name__}: {e}); it runs on its own")


class TensorRTLLMFinder(importlib.abc.MetaPathFinder):
    """On sys.meta_path: installs torch_budget as the tensorrt_llm package starts running (not when
    something only looks for it), and serves its virtual-memory module once that has run. Finds
    nothing itself: the other finders find the modules, their loaders load them."""

    _HOOKS = {_TRT_PACKAGE: (_install_for_tensorrt_llm, None), _TRT_MODULE: (None, _serve_tensorrt_llm)}

    def __init__(self):
        self._local = threading.local()  # set while this finder asks the others (no recursion)

    def find_spec(self, name: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        hooks = self._HOOKS.get(name)
        if hooks is None or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = next((s for s in (f.find_spec(name, path, target) for f in sys.meta_path
                                     if f is not self and hasattr(f, "find_spec")) if s is not None), None)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ServingLoader(spec.loader, *hooks)
        return spec


def run(value: Optional[str] = None) -> list[str]:
    """What the startup file calls: serves the stacks `value` (default: TORCH_BUDGET_SERVE) names in
    this process. Returns them; reports problems on stderr, never raises."""
    value = os.environ.get(VARIABLE, "") if value is None else value
    try:
        names = parse(value)
    except ValueError as e:
        _say(f"{e}; nothing is served")
        return []
    if "tensorrt_llm" in names and not any(isinstance(f, TensorRTLLMFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TensorRTLLMFinder())
    return names
