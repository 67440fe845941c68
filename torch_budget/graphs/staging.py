"""A runner's static inputs: device buffers, their pinned host shadows (one per shadow
slot), and staging a step's data into them with padding."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from .shadows import ShadowRing
from .static import AxisSize, BufferLayout, StaticInput, input_shape
from ..errors import InvalidArgumentError

__all__ = ["STEP_CACHE_ENTRIES", "StaticInputs"]


class _InputCopy:
    """How a step of n rows at one bucket writes one input: built once per (bucket, n).

    `data[s]` / `pad[s]`: the views of slot s's shadow (host inputs; one entry, the device
    buffer, for device inputs) that receive the rows and the padding (pad is None when the
    bucket has no padding). `track`: the rows are the flat prefix [0, data_end) of the
    shadow (batch axis first) and the padding the rest of the bucket, up to view_end, so a
    step may skip refilling padding no earlier step wrote (StaticInputs._dirty).
    """

    __slots__ = ("index", "name", "spec", "shape", "data", "pad", "track", "data_end", "view_end")

    def __init__(self, index: int, name: str, spec: StaticInput, shape: tuple, data: tuple,
                 pad: tuple | None, track: bool, data_end: int, view_end: int):
        self.index = index
        self.name = name
        self.spec = spec
        self.shape = torch.Size(shape)
        self.data = data
        self.pad = pad
        self.track = track
        self.data_end = data_end
        self.view_end = view_end


# How many (bucket, rows) pairs the per-step caches (staging copies, a runner's results) keep,
# least recently used dropped first: with an explicit bucket (agreed between ranks) the rows may
# be anything up to it, so caching every pair seen would grow without limit.
STEP_CACHE_ENTRIES = 1024


class StaticInputs:
    """The device buffer of every static input, and the pinned shadow slots of the host-sourced ones.

    Static memory, allocated at construction and kept until close(): see Note [Static buffer
    layout] and Note [Shadow ring] (one pinned allocation per host input holds every slot).
    stage() writes a step's data (host inputs into the next shadow slot, device inputs into
    their buffers) and pads the rest of the bucket; copy_to_device() is the shadow -> device
    copy that the first graph of each bucket captures.
    """

    def device_buffers(self) -> list[torch.Tensor]:
        """The device buffer of every static input."""
        return list(self._in_flat.values())

    def __init__(self, owner: str, specs: Mapping[str, StaticInput], axes: Mapping[str, AxisSize],
                 buckets: Sequence[int], shadow_slots: int, device: torch.device):
        self._label = owner
        self.device = device
        self._cuda = device.type == "cuda"
        self.specs = dict(specs)
        self.names = frozenset(self.specs)
        self.host_names = frozenset(n for n, s in self.specs.items() if s.source == "host")
        self.layouts = {
            name: BufferLayout({b: input_shape(spec, b, axes, owner) for b in buckets})
            for name, spec in self.specs.items()
        }
        self.slots = shadow_slots if self.host_names else 1
        self._in_flat: dict[str, torch.Tensor] = {}
        self._shadow_flat: dict[str, torch.Tensor] = {}
        slot_flats: list[dict[str, torch.Tensor]] = [{} for _ in range(self.slots)]
        for name, spec in self.specs.items():
            numel = self.layouts[name].numel
            self._in_flat[name] = torch.full((numel,), spec.pad_value, dtype=spec.dtype, device=device)
            if spec.source == "host":
                shadow = torch.empty((self.slots * numel,), dtype=spec.dtype, pin_memory=self._cuda)
                self._shadow_flat[name] = shadow.fill_(spec.pad_value)
                for slot in range(self.slots):
                    slot_flats[slot][name] = shadow[slot * numel:(slot + 1) * numel]
        self._slot_flat = slot_flats
        self._in_views = {b: {n: self.layouts[n].view(f, b) for n, f in self._in_flat.items()} for b in buckets}
        # _shadow_views[slot][bucket][name]; _copy_pairs[slot][bucket]: (device view, shadow view).
        self._shadow_views = [{b: {n: self.layouts[n].view(f, b) for n, f in flats.items()}
                               for b in buckets} for flats in slot_flats]
        self._copy_pairs = [{b: tuple((self._in_views[b][n], v) for n, v in views[b].items())
                             for b in buckets} for views in self._shadow_views]
        # _dirty[slot][input index]: shadow elements from here on hold the pad value (tracked
        # inputs only; see _InputCopy). Shadows start filled with it.
        self._dirty = [[0] * len(self.specs) for _ in range(self.slots)]
        fenced = self._cuda and bool(self.host_names)
        self._ring = ShadowRing(self.slots, torch.cuda.Event if fenced else None)
        # Built on first use, at most STEP_CACHE_ENTRIES: (bucket, n) -> (host copies, device copies).
        self._copies_cache: OrderedDict[tuple[int, int], tuple[tuple, tuple]] = OrderedDict()

    # -- buffers ------------------------------------------------------------------------

    def bucket_views(self, bucket: int) -> dict[str, torch.Tensor]:
        """name -> the device view the graphs of `bucket` read (a new dict)."""
        return dict(self._in_views[bucket])

    def full(self, name: str) -> torch.Tensor:
        """The full (largest) view of the device buffer of input `name`."""
        return self.layouts[name].full(self._in_flat[name])

    def full_views(self) -> dict[str, torch.Tensor]:
        return {n: self.layouts[n].full(f) for n, f in self._in_flat.items()}

    def shadow_full_views(self, slot: int) -> dict[str, torch.Tensor]:
        """The full views of the pinned shadows of one slot (`slot` in range)."""
        return {n: self.layouts[n].full(f) for n, f in self._slot_flat[slot].items()}

    @property
    def last_slot(self) -> int:
        """The shadow slot the latest step wrote."""
        return self._ring.last

    def acquire_slot(self) -> int:
        """The next shadow slot, once the work that last read it has finished (Note [Shadow ring])."""
        return self._ring.acquire()

    @property
    def device_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._in_flat.values())

    @property
    def shadow_nbytes(self) -> int:
        """Pinned host bytes of the shadows, all slots."""
        return sum(t.numel() * t.element_size() for t in self._shadow_flat.values())

    def close(self) -> None:
        """Drop every buffer and shadow (the runner has synchronised and destroyed its graphs)."""
        for store in (self._in_flat, self._shadow_flat, self._in_views, self._copies_cache):
            store.clear()
        self._slot_flat, self._shadow_views, self._copy_pairs = [], [], []
        self._ring = ShadowRing(self.slots, None)

    # -- staging ------------------------------------------------------------------------

    def _copies(self, bucket: int, n: int) -> tuple[tuple, tuple]:
        """(host copies, device copies) for a step of n rows at `bucket`; cached (STEP_CACHE_ENTRIES)."""
        key = (bucket, n)
        cache = self._copies_cache
        staging = cache.get(key)
        if staging is not None:
            cache.move_to_end(key)
        else:
            host, device = [], []
            for index, (name, spec) in enumerate(self.specs.items()):
                cap = self.layouts[name].shapes[bucket]
                axis = spec.batch_axis
                shape = cap if axis is None else cap[:axis] + (n,) + cap[axis + 1:]
                if spec.source == "host":
                    targets = [self._shadow_views[s][bucket][name] for s in range(self.slots)]
                else:
                    targets = [self._in_views[bucket][name]]
                data = tuple(t if axis is None else t.narrow(axis, 0, n) for t in targets)
                pad = None
                if axis is not None and n < cap[axis]:
                    pad = tuple(t.narrow(axis, n, cap[axis] - n) for t in targets)
                copy = _InputCopy(index, name, spec, shape, data, pad, track=spec.source == "host" and axis == 0,
                                  data_end=math.prod(shape), view_end=math.prod(cap))
                (host if spec.source == "host" else device).append(copy)
            if len(cache) >= STEP_CACHE_ENTRIES:
                cache.popitem(last=False)
            staging = cache[key] = (tuple(host), tuple(device))
        return staging

    def stage(self, bucket: int, n: int, data: Mapping[str, object]) -> int:
        """Write a step's data: host inputs into the next shadow slot, device inputs into
        their static buffers; returns the slot. See Note [Shadow ring].

        Every input is checked before any buffer is written, so a refused step leaves the
        device buffers, the shadows and the ring as they were."""
        keys = data.keys()
        if not (keys <= self.names and self.host_names <= keys):
            self._reject_names(data)
        host, device = self._copies(bucket, n)
        # None: the value fits its copy as it is (the common case, tested inline: a step is on
        # the hot path); else the value, checked and converted, for _fill.
        Tensor = torch.Tensor
        host_values = [None if ((value := data[copy.name]).__class__ is Tensor and value.shape == copy.shape
                                and value.dtype == copy.spec.dtype and value.is_cpu and not value.requires_grad)
                       else self._checked(copy, value, n, bucket) for copy in host]
        device_values = [None if copy.name not in data
                         or ((value := data[copy.name]).__class__ is Tensor and value.shape == copy.shape
                             and value.dtype == copy.spec.dtype and not value.requires_grad)
                         else self._checked(copy, value, n, bucket) for copy in device]
        slot = self._ring.acquire()
        dirty = self._dirty[slot]
        for copy, checked in zip(host, host_values):
            if checked is None:
                if copy.track:
                    # Refill padding only where an earlier step of this slot left rows, and
                    # then all of them, so that smaller steps after it find clean padding.
                    end = dirty[copy.index]
                    if end > copy.data_end:
                        if end <= copy.view_end:
                            copy.pad[slot].fill_(copy.spec.pad_value)
                        else:
                            self._slot_flat[slot][copy.name][copy.data_end:end].fill_(copy.spec.pad_value)
                    dirty[copy.index] = copy.data_end
                elif copy.pad is not None:
                    copy.pad[slot].fill_(copy.spec.pad_value)
                copy.data[slot].copy_(data[copy.name])
            else:
                self._fill(copy.spec, self._shadow_views[slot][bucket][copy.name], checked)
                dirty[copy.index] = max(dirty[copy.index], copy.view_end)
        for copy, checked in zip(device, device_values):
            if copy.name not in data:
                continue
            if checked is None:
                # Callers may write device buffers in place, so their padding is always refilled.
                if copy.pad is not None:
                    copy.pad[0].fill_(copy.spec.pad_value)
                copy.data[0].copy_(data[copy.name])
            else:
                self._fill(copy.spec, self._in_views[bucket][copy.name], checked)
        return slot

    def _checked(self, copy: _InputCopy, value: object, n: int, bucket: int) -> torch.Tensor | None:
        """None when `value` is a tensor of exactly the copy's shape and dtype (on the CPU for a
        host input) that autograd does not track; otherwise `value` checked against the input's
        static buffer at `bucket` and made a tensor, or an exception naming the input."""
        if (type(value) is torch.Tensor and value.shape == copy.shape and value.dtype == copy.spec.dtype
                and not value.requires_grad and (value.is_cpu or copy.spec.source != "host")):
            return None
        spec = copy.spec
        where = f"{self._label}: input {spec.name!r}"
        if not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InvalidArgumentError(f"{where} cannot be read as a tensor: got {type(value).__name__} ({e})") from None
        # A step's data is copied into buffers the graph reads; gradients cannot flow through a
        # replay, and copying a tracked tensor in place would make the buffers tracked too.
        value = value.detach()
        if spec.source == "host" and value.device.type != "cpu":
            raise InvalidArgumentError(
                f"{where} is host-sourced but got a tensor on {value.device}; pass a CPU tensor "
                "(reading a device tensor back would synchronise) or declare source='device'"
            )
        if not torch.can_cast(value.dtype, spec.dtype):  # a narrower type of the same kind is copied as torch copies
            raise TypeError(f"{where} has dtype {spec.dtype}; got {value.dtype}, a kind that does not cast to it "
                            "(e.g. float into an integer input)")
        shape, cap = tuple(value.shape), tuple(self.layouts[spec.name].shapes[bucket])
        if len(shape) != len(cap):
            raise InvalidArgumentError(f"{where} expects {len(cap)} dims like {cap} at bucket {bucket}, got shape {shape}")
        axis = spec.batch_axis
        if axis is not None and shape[axis] != n:
            raise InvalidArgumentError(f"{where} has {shape[axis]} rows on batch axis {axis}, but the step has n={n}")
        if any(s > c for s, c in zip(shape, cap)):
            raise InvalidArgumentError(f"{where} has shape {shape}, larger than its static buffer {cap} at bucket {bucket}")
        dims = list(spec.shape)
        if axis is not None:
            dims.insert(axis, None)
        short = [d for d, declared in enumerate(dims) if isinstance(declared, int) and shape[d] != declared]
        if short:  # only the batch axis and symbolic axes may be shorter, padded
            raise InvalidArgumentError(f"{where} has shape {shape}; its dimension(s) {short} are declared fixed "
                                       f"({tuple(spec.shape)}), so they must be {[dims[d] for d in short]}")
        return value

    def _reject_names(self, data: Mapping[str, object]) -> None:
        unknown = set(data) - self.names
        if unknown:
            raise InvalidArgumentError(f"{self._label}: unknown static input(s) {sorted(unknown)}; declared: {sorted(self.specs)}")
        missing = [name for name in self.specs if name in self.host_names and name not in data]
        raise InvalidArgumentError(
            f"{self._label}: host input(s) {missing} missing; every host-sourced input is "
            "copied by the graph each step, so each step must provide it"
        )

    @staticmethod
    def _fill(spec: StaticInput, target: torch.Tensor, value: torch.Tensor) -> None:
        """Copy a value _checked against `target` into its leading corner and pad the rest."""
        shape, cap = tuple(value.shape), tuple(target.shape)
        if shape == cap:
            target.copy_(value)
            return
        axis = spec.batch_axis
        differs = [d for d in range(len(cap)) if shape[d] != cap[d]]
        if differs == [axis]:
            n = shape[axis]
            target.narrow(axis, n, cap[axis] - n).fill_(spec.pad_value)
            target.narrow(axis, 0, n).copy_(value)
        else:
            target.fill_(spec.pad_value)
            target[tuple(slice(0, s) for s in shape)].copy_(value)

    def copy_to_device(self, bucket: int, slot: int) -> None:
        """Shadow slot -> device static copies; captured into the slot's first graph of each bucket."""
        for static, shadow in self._copy_pairs[slot][bucket]:
            static.copy_(shadow, non_blocking=True)

    def release_slot(self, slot: int) -> None:
        """The work reading `slot` has been queued on the current stream. See Note [Shadow ring]."""
        if self._ring.fenced:
            self._ring.release(slot, torch.cuda.current_stream(self.device))
