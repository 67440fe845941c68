"""TensorRT-LLM's virtual memory (tensorrt_llm._torch.virtual_memory) over torch_budget: change the import.

    from torch_budget.adapters import tensorrt_llm as virtual_memory
    # was: from tensorrt_llm._torch import virtual_memory
    # or:  from torch_budget.adapters.tensorrt_llm import RestoreMode, scope, release_with_tag, materialize_with_tag

    with virtual_memory.scope("model", virtual_memory.RestoreMode.PINNED):
        model = build_model()                       # weights: kept across a release
    with virtual_memory.scope("kv_cache"):          # RestoreMode.NONE: contents undefined after materialize
        kv = torch.empty(..., device="cuda")
    virtual_memory.release_with_tag("model", "kv_cache")      # device memory back to the driver
    virtual_memory.materialize_with_tag("model", "kv_cache")  # same addresses, the model's contents back

TensorRT-LLM's own executor (its PyTorch backend's py_executor_creator, LLM.sleep / LLM.wakeup) imports
tensorrt_llm._torch.virtual_memory itself; serve_tensorrt_llm() points it here, one line before the LLM is built:

    from torch_budget.adapters.tensorrt_llm import serve_tensorrt_llm
    serve_tensorrt_llm()
    llm = LLM(model, enable_sleep=True)

That reaches this process only; TensorRT-LLM runs its executor in worker processes of its own unless
TLLM_WORKER_USE_SINGLE_PROCESS=1. TORCH_BUDGET_SERVE=tensorrt_llm in the environment serves every process
started with it, workers included, from their first import of tensorrt_llm (torch_budget.startup).

The mapping (TensorRT-LLM name -> what torch_budget does):
  scope(tag, mode=NONE)        torch_budget.region(<tag, mode>, route="vmm"); nests, the innermost decides;
                               yields an object with .tag and .mode
  maybe_scope(enable, tag, mode)  scope(tag, mode) when enable, else nothing (yields None)
  preserve_contents()          inside a NONE or MEMSET scope: scope(<its tag>, CPU), so metadata allocated
                               here is released with its owner and comes back with its contents; else nothing
  RestoreMode.NONE / MEMSET / CPU / PINNED   backup "none" / "memset" (zeros) / "cpu" (pageable host
                               memory) / "pinned" (pinned host memory), taken at release_with_tag
  release_with_tag(*tags)      torch_budget.release(<each tag's modes>, device="all") of those still mapped
  materialize_with_tag(*tags)  torch_budget.restore(<each tag's modes>, device="all") of those released

TensorRT-LLM decides the backup per allocation (the scope's mode), so each (tag, mode) pair is a torch_budget
tag of its own: "kv_cache" (NONE), "model+pinned", "model+cpu", "model+memset"; release_with_tag("model")
releases all of "model"'s. Both calls skip what is already in the asked state and return how many memory
blobs they acted on, as TensorRT-LLM counts them: one per live allocation, on every device (memory torch_budget
caches for the tag is released and restored with it, and counts nothing). A release is all or
nothing; a materialize that fails leaves the tags before it materialized and the failing tag released, as
TensorRT-LLM's does; it raises torch.cuda.OutOfMemoryError when the memory is not there, and a later call
can succeed (the backup is kept). Tags are str (TensorRT-LLM's ExecutorMemoryType members are).

A plan's budgets (torch_budget.planner, Plan.apply) bound TensorRT-LLM's memory through its tags: a budget on
"kv_cache" bounds "kv_cache" and every "kv_cache+<mode>" together (Note [Tag families] in the core), so
plan.apply(tags=PLAN_TAGS) puts the weights line on TensorRT-LLM's "model_weights" and the KV line on its
"kv_cache", whatever modes its SleepConfig picks (releases before MODEL_WEIGHTS_MAIN kept the weights under
"model": {**PLAN_TAGS, "weights": "model"}). ExecutorMemoryType and verify_sleep_wakeup_tags are TensorRT-LLM's
own, for the releases whose virtual_memory module exports them.

Scopes are per thread, torch_budget's (TensorRT-LLM's allocator setting is process-wide). scope(), maybe_scope() and
preserve_contents() are entered once and ended once: TensorRT-LLM's are contextlib generator scopes, which
refuse a second entry too; an end without an entry (contextlib ran the body, registering the tag and mode)
and a second end (which it let pass) raise StateError here and change nothing. What torch_budget
cannot do raises UnsupportedError (a TorchBudgetError and a NotImplementedError): a device without CUDA
virtual memory management. Importing this module installs torch_budget (torch_budget.install(), settings
from TORCH_BUDGET_CONF) when a CUDA device is there and CUDA has not started, as the torch_memory_saver
adapter does, whose UnsupportedError this module shares; the first scope installs it otherwise, and raises
InstallError, saying so, when CUDA started on torch's own allocator.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from typing import NamedTuple, Optional

import torch_budget
from torch_budget import _scope, diagnostics, sleep
from torch_budget._validate import tag_name
from torch_budget.adapters._common import TagRegistry, allocated_anywhere, ensure_installed, install_at_import
from torch_budget.errors import InvalidArgumentError, UnsupportedError

__all__ = ["RestoreMode", "ExecutorMemoryType", "maybe_scope", "scope", "preserve_contents", "release_with_tag",
           "materialize_with_tag", "verify_sleep_wakeup_tags", "serve_tensorrt_llm", "PLAN_TAGS", "UnsupportedError"]


class RestoreMode(enum.IntEnum):
    """How the contents of a scope's memory come back at materialize_with_tag (TensorRT-LLM's
    CudaVirtualMemoryAllocatorRestoreMode, in its order)."""
    NONE = 0  # undefined
    MEMSET = 1  # zeros
    CPU = 2  # copied back from pageable host memory
    PINNED = 3  # copied back from pinned host memory


class ExecutorMemoryType(str, enum.Enum):
    """The tags TensorRT-LLM's executor allocates under (its virtual_memory.ExecutorMemoryType)."""
    SAMPLER = "sampler"
    DRAFTER = "drafter"
    GUIDED_DECODER = "guided_decoder"
    SPEC_RESOURCES = "spec_resource_manager"
    INIT_KV_CACHE = "_no_capture_init_kv_cache"
    INIT_EXTRA_RESOURCES = "_no_capture_init_extra_resources"
    MODEL_EXTRA = "model_extra"
    EXTRA_RESOURCES = "executor_extra"
    KV_CACHE = "kv_cache"
    MODEL_ENGINE_MAIN = "model"
    MODEL_ENGINE_DRAFT = "draft_model"
    MODEL_WEIGHTS_MAIN = "model_weights"
    MODEL_WEIGHTS_DRAFT = "draft_model_weights"

    def __str__(self) -> str:
        return self.value


def verify_sleep_wakeup_tags(tags_strs) -> list[ExecutorMemoryType]:
    """Each of `tags_strs` as an ExecutorMemoryType; ValueError naming an unknown one and the known ones."""
    out = []
    for tag in tags_strs:
        try:
            out.append(ExecutorMemoryType(tag))
        except ValueError:
            raise ValueError(f"Unknown memory tag {tag!r}. Valid tags are: "
                             f"{[t.value for t in ExecutorMemoryType]}") from None
    return out


# Ledger category -> the TensorRT-LLM tag its memory is allocated under, for Plan.apply(tags=PLAN_TAGS): each
# budget bounds the tag with every mode (Note [Tag families]).
PLAN_TAGS = {"weights": ExecutorMemoryType.MODEL_WEIGHTS_MAIN.value, "kv_pool": ExecutorMemoryType.KV_CACHE.value}


_BACKUPS = {RestoreMode.NONE: "none", RestoreMode.MEMSET: "memset", RestoreMode.CPU: "cpu",
            RestoreMode.PINNED: "pinned"}


class _Scope(NamedTuple):
    tag: str
    mode: RestoreMode


def _mode(mode) -> RestoreMode:
    """Our RestoreMode, or TensorRT-LLM's own (its binding's members carry the same names)."""
    if isinstance(mode, RestoreMode):
        return mode
    name = getattr(mode, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"mode must be a RestoreMode, got {type(mode).__name__} ({mode!r})")
    try:
        return RestoreMode[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown restore mode {name!r}: expected one of "
                                   f"{', '.join(m.name for m in RestoreMode)}") from None


def _tag(tag, what: str = "tag") -> str:
    """A tag as a plain str (TensorRT-LLM passes StrEnum members)."""
    return str.__str__(tag_name(tag, what))


# Note [TensorRT-LLM tags] mirrors Note [torch_memory_saver tags]: the torch_budget tag of (tag, mode) is
# `tag` for NONE and "tag+<backup>" otherwise; names are checked not to collide.
# TensorRT-LLM's tag "untagged" is torch_budget's "trt_untagged": under torch_budget's own
# "untagged" (memory of no tag) nothing could ever be released.
_registry = TagRegistry("restore mode", rename=lambda tag: "trt_untagged" if tag == "untagged" else tag)
_scopes = threading.local()  # stack: the scopes open on this thread, innermost last


def _stack() -> list[_Scope]:
    if not hasattr(_scopes, "stack"):
        _scopes.stack = []
    return _scopes.stack


def _install() -> None:
    ensure_installed(lambda e: (
        "torch_budget's TensorRT-LLM virtual memory serves memory through torch_budget, which must replace "
        "torch's CUDA allocator before CUDA starts: import torch_budget.adapters.tensorrt_llm (or call "
        f"torch_budget.install()) before the first CUDA tensor or call. {e}"))


@_scope.once(lambda tag=None, *_, **__: f"scope({str(tag)!r})")  # TensorRT-LLM's tags are StrEnums
def scope(tag: str, mode: RestoreMode = RestoreMode.NONE) -> Iterator[_Scope]:
    """Allocations inside are released and materialized with `tag`; `mode` says what their contents
    are after a materialize. Nestable: the innermost scope decides."""
    entered = _Scope(_tag(tag), _mode(mode))
    _install()
    if diagnostics.route_for("vmm") != "vmm":
        raise UnsupportedError("this device has no CUDA virtual memory management, which release_with_tag needs "
                               "to give memory back and map it again at the same addresses")
    name = _registry.register(entered.tag, _BACKUPS[entered.mode])
    stack = _stack()
    stack.append(entered)
    try:
        with torch_budget.region(name, route="vmm"):
            yield entered
    finally:
        # Its own entry, not the innermost: an end region() refuses (out of order, or from another
        # thread) must not take off a scope still open inside this one, which preserve_contents reads.
        for at in range(len(stack) - 1, -1, -1):
            if stack[at] is entered:
                del stack[at]
                break


@_scope.once(lambda enable=None, tag=None, *_, **__: f"maybe_scope({enable!r}, {str(tag)!r})")
def maybe_scope(enable: bool, tag: str, mode: RestoreMode = RestoreMode.NONE) -> Iterator[Optional[_Scope]]:
    """scope(tag, mode) when `enable`, else a context that does nothing (and yields None)."""
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__} ({enable!r})")
    if not enable:
        yield None
        return
    with scope(tag, mode) as entered:
        yield entered


@_scope.once(lambda: "preserve_contents()")
def preserve_contents() -> Iterator[None]:
    """Inside a scope whose contents are dropped (NONE, MEMSET): allocations here keep the scope's tag,
    so they are released with it, and come back with their contents (CPU). Elsewhere: nothing."""
    stack = _stack()
    if not stack or stack[-1].mode not in (RestoreMode.NONE, RestoreMode.MEMSET):
        yield
        return
    with scope(stack[-1].tag, RestoreMode.CPU):
        yield


def _tags(tags) -> list[str]:
    names = [_tag(t, "a tag") for t in tags]
    return list(dict.fromkeys(names))  # a tag named twice acts once, as TensorRT-LLM's second pass finds nothing


def release_with_tag(*tags: str) -> int:
    """Gives the device memory of `tags` back to the driver on every device, backing up what each
    scope's mode asks for. Returns the number of blobs released (see the module's note)."""
    names = _tags(tags)
    if not names:
        return 0
    _install()
    if not allocated_anywhere():
        return 0
    with _registry.lock:
        asleep = sleep.released_tags()
        todo = [(n, b) for tag in names for n, b in sorted(_registry.of(tag).items()) if n not in asleep]
        # Backups that keep contents first: a failure then undoes before any contents were dropped.
        todo.sort(key=lambda item: item[1] not in sleep.KEEPS)
        done: list[str] = []
        count = 0
        try:
            for name, backup in todo:
                count += torch_budget.release(name, backup=backup, device="all")["allocations"]
                done.append(name)
        except BaseException as failure:  # all or nothing
            _undo_each(done, lambda name: torch_budget.restore(name, device="all"), "restoring", failure)
            raise
        return count


def materialize_with_tag(*tags: str) -> int:
    """Maps memory back behind `tags` at the same addresses on every device and restores the contents
    their modes kept. Returns the number of blobs materialized (see the module's note)."""
    names = _tags(tags)
    if not names:
        return 0
    _install()
    if not allocated_anywhere():
        return 0
    count = 0
    with _registry.lock:
        asleep = sleep.released_tags()
        for tag in names:
            done: list[str] = []
            try:
                for name in sorted(n for n in _registry.of(tag) if n in asleep):
                    count += torch_budget.restore(name, device="all")["allocations"]
                    done.append(name)
            except BaseException as failure:  # the failing tag stays released as a whole
                _undo_each(done, lambda name: torch_budget.release(name, backup=asleep[name], device="all"),
                           "releasing", failure)
                raise
    return count


def _undo_each(names: list[str], undo, doing: str, failure: BaseException) -> None:
    """Undoes each of `names` (latest first) after `failure`; one whose undo fails too (out of memory
    is a torch error, not torch_budget's) does not stop the others, and is noted on `failure`, which
    stays the error raised."""
    for name in reversed(names):
        try:
            undo(name)
        except Exception as e:  # noqa: BLE001 -- the failure that stopped the call is the one raised
            failure.add_note(f"and {doing} {name!r} again to undo it failed too ({type(e).__name__}: {e}), "
                             "so it stays as the failure left it")


_SERVED = ("scope", "maybe_scope", "preserve_contents", "release_with_tag", "materialize_with_tag")
_TRT_MODULE = "tensorrt_llm._torch.virtual_memory"


def serve_tensorrt_llm() -> int:
    """Makes TensorRT-LLM's own executor use this adapter: the functions of
    tensorrt_llm._torch.virtual_memory named in _SERVED become this module's, and so does every
    name a loaded tensorrt_llm module bound to one of them (py_executor_creator imports `scope`
    as `virtual_memory_scope`; LLM.sleep imports release_with_tag when it runs, so it finds this
    one). TensorRT-LLM's RestoreMode and ExecutorMemoryType stay its own: scope takes them. Call it
    in the process that builds the executor, before it is built. It also adds tensorrt_llm to
    TORCH_BUDGET_SERVE in this process's environment, so that the worker processes TensorRT-LLM
    starts afterwards, which inherit it, are served too (torch_budget.startup, from the wheel's
    startup file; a Ray cluster started elsewhere needs the variable in its runtime environment).
    Idempotent; returns the number of names rebound. ImportError where TensorRT-LLM is not
    installed."""
    import importlib
    import os
    import types

    vm = importlib.import_module(_TRT_MODULE)
    ours = {name: globals()[name] for name in _SERVED}
    theirs = {id(getattr(vm, name)): ours[name] for name in _SERVED
              if hasattr(vm, name) and getattr(vm, name) is not ours[name]}
    rebound = 0
    for name in _SERVED:
        if getattr(vm, name, None) is not ours[name]:
            setattr(vm, name, ours[name])
            rebound += 1
    # every loaded module of the package: an import binds each submodule on its parent
    todo, seen = [importlib.import_module("tensorrt_llm")], set()
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith("tensorrt_llm."):
                todo.append(value)
            elif module is not vm and id(value) in theirs:
                setattr(module, attr, theirs[id(value)])
                rebound += 1
    # torch_budget.startup's variable (which imports this module: not imported from here)
    stacks = [v.strip() for v in os.environ.get("TORCH_BUDGET_SERVE", "").split(",") if v.strip()]
    if "tensorrt_llm" not in stacks:
        os.environ["TORCH_BUDGET_SERVE"] = ",".join(stacks + ["tensorrt_llm"])
    return rebound


# torch's allocator can only be replaced before CUDA starts, and TensorRT-LLM starts it early.
install_at_import(_install)
