"""SGLang's memory saver over torch_budget: an SGLang plugin that installs torch_budget and points SGLang's
memory-saver adapter at torch_budget's torch_memory_saver adapter.

Installing torch_budget into SGLang's environment is the whole set-up: the package registers the entry
point `torch_budget = torch_budget.adapters.sglang:register` in the group `sglang.srt.plugins`, which
SGLang's load_plugins() runs early in every process (SGLANG_PLUGINS, when set, must name torch_budget).

    pip install torch_budget
    TORCH_BUDGET_CONF="budget:0.9" python -m sglang.launch_server --model-path MODEL \\
        --enable-memory-saver --enable-weights-cpu-backup
    # SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 releases the captured CUDA graphs' memory too, as in SGLang

The mapping (SGLang name -> what torch_budget does):
  register()                    torch_budget.install() (TORCH_BUDGET_CONF), and in SGLang's memory-saver
                                adapter module (sglang.srt.utils.torch_memory_saver_adapter, or the older
                                sglang.srt.torch_memory_saver_adapter) torch_memory_saver and its singleton
                                become torch_budget.adapters.torch_memory_saver's
  --enable-memory-saver         SGLang's own choice between its real adapter (torch_budget's, now) and its no-op
  region("weights", enable_cpu_backup=--enable-weights-cpu-backup)   torch_budget tag "weights+pinned"
                                with the flag (a pinned backup at release), "weights" without (no backup)
  region("kv_cache")            torch_budget tag "kv_cache", no backup
  cuda_graph(..., tag="cuda_graph")   the graph captured under tag "cuda_graph": its private pool is released
                                with it (SGLang captures so under SGLANG_MEMORY_SAVER_CUDA_GRAPH=1)
  pause(tag) / resume(tag)      release / restore of the tag's torch_budget tags on every device
                                (release_memory_occupation / resume_memory_occupation)
  configure_subprocess()        nothing to set: each SGLang process loads the plugin and installs torch_budget
The rest is torch_budget.adapters.torch_memory_saver's mapping (its module docstring).

What torch_budget cannot do raises UnsupportedError (a TorchBudgetError and a NotImplementedError):
torch_memory_saver's own LD_PRELOAD hook in the process (it would serve CUDA allocations beside
torch_budget), a memory-saver adapter module that does not read torch_memory_saver by the names SGLang's
do, and what torch_memory_saver's adapter refuses (disk backups, TMS_INIT_ENABLE, ...). SGLang logs what
a plugin raises and carries on; when CUDA started on torch's own allocator before the plugin ran, the
memory saver's first region raises InstallError saying so. Where torch sees no CUDA device (a ROCm or CPU
build, a process with no GPU visible) the plugin does nothing.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch_budget
from torch_budget import _runtime
from torch_budget.adapters import torch_memory_saver as _saver_module
from torch_budget.adapters._common import ensure_installed
from torch_budget.errors import UnsupportedError

__all__ = ["register", "ADAPTER_MODULES", "TAGS", "UnsupportedError"]

# SGLang's memory-saver adapter, where recent and older SGLang keep it.
ADAPTER_MODULES = ("sglang.srt.utils.torch_memory_saver_adapter", "sglang.srt.torch_memory_saver_adapter")
# sglang.srt.constants: GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH
TAGS = ("weights", "kv_cache", "cuda_graph")

logger = logging.getLogger(__name__)


def register() -> None:
    """The `sglang.srt.plugins` entry point. Idempotent; does nothing where torch sees no CUDA device,
    and starts no CUDA driver (Note [Installing without the driver])."""
    if _runtime.cuda_devices() == 0:
        logger.debug("torch_budget: no CUDA device in this process; nothing to install")
        return
    _refuse_preload()
    pointed = [name for name in ADAPTER_MODULES if _point(name)]
    logger.info("torch_budget serves SGLang's memory saver through %s", ", ".join(pointed) or "no adapter module")
    ensure_installed(lambda e: (
        f"SGLang loaded torch_budget's plugin, and torch_budget.install() failed: {e}. torch_budget "
        "replaces torch's CUDA allocator, which it can do only before CUDA starts: let SGLang load its "
        "plugins first, or set SGLANG_PLUGINS without torch_budget to run SGLang on torch's allocator"))


def _refuse_preload() -> None:
    preload = os.environ.get("LD_PRELOAD", "")
    hooks = [p for p in preload.replace(":", " ").split() if "torch_memory_saver" in os.path.basename(p)]
    if hooks:
        raise UnsupportedError(
            f"LD_PRELOAD holds torch_memory_saver's hook ({', '.join(hooks)}), which would serve CUDA allocations "
            "beside torch_budget: remove it (torch_budget's configure_subprocess() sets nothing, so SGLang's "
            "processes start without it)")


def _point(name: str) -> bool:
    """Points the memory-saver adapter module `name` at torch_budget's torch_memory_saver adapter;
    False when this SGLang has no such module."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            return False
        raise
    if not hasattr(module, "import_error") or not hasattr(module, "TorchMemorySaverAdapter"):
        raise UnsupportedError(
            f"{name} does not read torch_memory_saver through `torch_memory_saver`, `_memory_saver` and "
            "`import_error` as the SGLang versions torch_budget knows do, so it cannot be pointed at torch_budget")
    module.torch_memory_saver = _saver_module
    setattr(module, "_memory_saver", _saver_module.torch_memory_saver)
    module.import_error = None
    return True
