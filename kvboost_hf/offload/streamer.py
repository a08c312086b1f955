"""Layer streaming: decoder layers that do not fit on the device are copied in from host memory as they run.

Each streamed decoder layer keeps every tensor it owns (parameters, buffers and plain tensor attributes such as
repacked quantized weights) in one host buffer (page-locked on CUDA). The device holds ``num_slots`` fixed
buffers ("slots") as large as the largest streamed layer. One accelerate ``ModelHook`` per streamed layer:

* before layer i runs, its tensors are bound to views of the slot it was copied into (copied now if it was not
  prefetched: a *reload*), and the copy of the next streamed layer (wrapping to the first one for the next
  forward) is issued into the next slot in round-robin order, never the slot layer i reads;
* after layer i runs, its slot is released and its tensors are bound back to the host views, so between forwards
  the model's tensors hold the real weights (digests, ``state_dict`` and repr see them).

On CUDA the copies run on a side stream: the compute stream waits on a per-slot "copy done" event and the copy
stream waits on a per-slot "compute done" event before overwriting a slot, so the host never synchronises on the
hot path. On CPU the same code runs with synchronous copies (host buffer and slot are both CPU tensors).

Invariants: a slot is overwritten only after the compute of the layer that last read it (recorded event, or the
point where that layer raised); each use of a streamed layer reads a copy made for that use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch
from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module

from kvboost_hf.core.errors import ArgumentTypeError, CapacityError, ConfigError, InputError
from kvboost_hf.core.keys import model_digest
from kvboost_hf.offload.settings import LayerStreamingConfig

logger = logging.getLogger(__name__)

ALIGNMENT = 256  # bytes; every tensor of a packed layer starts at a multiple of this
_STREAMER_ATTRIBUTE = "_kvboost_layer_streamer"
_LAYER_LIST_NAMES = ("layers", "h", "blocks")


@dataclass
class StreamingStats:
    """Counters of a :class:`LayerStreamer` (bytes and seconds).

    ``bytes_per_forward`` is the sum of the streamed layers' tensor bytes (what one full forward copies);
    ``last_forward_bytes`` what the latest forward used; ``bytes_streamed`` every byte copied host to device
    (a prefetch that no forward used, e.g. after the last one, included). ``reloads`` counts layers copied when
    they were about to run instead of during the previous layer (the first forward, and after a forward that
    stopped inside a layer): their copy could not overlap compute. ``wait_seconds``: time the compute waited
    for copies (CUDA: measured with events; CPU: the synchronous copies).
    """

    streamed_layers: int
    resident_layers: int
    bytes_per_forward: int
    resident_bytes: int
    slot_bytes: int
    forwards: int = 0
    loads: int = 0
    reloads: int = 0
    bytes_streamed: int = 0
    last_forward_bytes: int = 0
    wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True)
class _TensorRef:
    """Where one tensor of a layer lives (``kind``: parameter, buffer or attribute) and its place in the buffer."""

    module: torch.nn.Module
    name: str
    kind: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def bind(self, tensor: torch.Tensor) -> None:
        if self.kind == "parameter":
            parameter = self.module._parameters[self.name]
            assert parameter is not None, "a bound parameter is never removed"
            parameter.data = tensor
        elif self.kind == "buffer":
            self.module._buffers[self.name] = tensor
        else:
            self.module.__dict__[self.name] = tensor


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _direct_tensors(owner: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``(owner, name, kind, tensor)`` for the tensors ``owner`` itself holds (kind: parameter, buffer, attribute)."""
    found: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = [
        (owner, n, "parameter", p) for n, p in owner._parameters.items() if p is not None
    ]
    found += [(owner, n, "buffer", b) for n, b in owner._buffers.items() if b is not None]
    found += [
        (owner, n, "attribute", t)
        for n, t in vars(owner).items()
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
    ]
    return found


def owned_tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute of ``module`` and its children (see
    :func:`_direct_tensors`); quantized linear layers keep repacked weights in plain attributes."""
    return [entry for owner in module.modules() for entry in _direct_tensors(owner)]


def _unique_bytes(entries: list[tuple[torch.nn.Module, str, str, torch.Tensor]], aligned: bool = False) -> int:
    """Bytes of the distinct tensors in ``entries`` (each rounded up to :data:`ALIGNMENT` if ``aligned``)."""
    unique = {id(entry[3]): entry[3] for entry in entries}.values()
    return sum(_aligned(_tensor_bytes(t)) if aligned else _tensor_bytes(t) for t in unique)


def layer_device_bytes(layer: torch.nn.Module) -> int:
    """Bytes ``layer`` takes in a slot: its distinct tensors, each rounded up to :data:`ALIGNMENT` (the size the
    streamer packs it to; for a device budget, see :mod:`kvboost_hf.offload.budget`)."""
    return _unique_bytes(owned_tensors(layer), aligned=True)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (a ``ModuleList`` named layers/h/blocks of ``num_hidden_layers``)."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr, operator]
    count = int(config.num_hidden_layers)
    for name, module in model.named_modules():
        is_list = isinstance(module, torch.nn.ModuleList) and len(module) == count
        if is_list and name.split(".")[-1] in _LAYER_LIST_NAMES:
            return module
    raise InputError(f"{type(model).__name__}: no ModuleList of its {count} decoder layers found to stream")


class _StreamedLayer:
    """One streamed layer: its tensors packed in one host buffer, with views of that buffer and of each slot."""

    def __init__(self, index: int, module: torch.nn.Module, pin: bool) -> None:
        self.index = index
        self.module = module
        refs: list[_TensorRef] = []
        tensors: list[torch.Tensor] = []
        offsets: dict[int, int] = {}
        size = 0
        for owner, name, kind, tensor in owned_tensors(module):
            if id(tensor) not in offsets:
                offsets[id(tensor)] = size
                tensors.append(tensor)
                size += _aligned(_tensor_bytes(tensor))
            refs.append(_TensorRef(owner, name, kind, offsets[id(tensor)], tuple(tensor.shape), tensor.dtype))
        self.refs = refs
        self.nbytes = size
        self.tensor_bytes = sum(_tensor_bytes(t) for t in tensors)
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        for tensor in tensors:
            start = offsets[id(tensor)]
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self.host[start : start + flat.numel()].copy_(flat)
        self.host_views = self.views(self.host)
        self.slot_views: list[list[torch.Tensor]] = []
        self.verified = False  # a forward ran and left the layer's tensors as bound
        self.bind(self.host_views)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor of the layer as a view of ``buffer`` (laid out like the host buffer)."""
        views = []
        for ref in self.refs:
            nbytes = torch.Size(ref.shape).numel() * torch.empty((), dtype=ref.dtype).element_size()
            views.append(buffer[ref.offset : ref.offset + nbytes].view(ref.dtype).view(ref.shape))
        return views

    def bind(self, views: list[torch.Tensor]) -> None:
        for ref, view in zip(self.refs, views, strict=True):
            ref.bind(view)

    def changed(self, views: list[torch.Tensor]) -> bool:
        """True when the module's tensors are no longer exactly ``views`` (a forward created or replaced some,
        e.g. a quantized linear layer repacking its weights lazily)."""
        current = owned_tensors(self.module)
        if len(current) != len(views):
            return True
        return any(
            t.data_ptr() != v.data_ptr() or t.shape != v.shape or t.dtype != v.dtype
            for (*_, t), v in zip(current, views, strict=True)
        )


class _StreamHook(ModelHook):
    """The accelerate hook of one streamed layer: it only tells the streamer that the layer starts and ends."""

    def __init__(self, streamer: LayerStreamer, order: int) -> None:
        self.streamer = streamer
        self.order = order

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self.streamer._before_layer(self.order)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output):
        self.streamer._after_layer(self.order)
        return output


@dataclass
class _SlotState:
    owner: int | None = None  # streamed layer (order) whose copy the slot holds
    running: bool = False  # the owner is bound to the slot and its forward has not returned


@dataclass
class _CudaSync:
    copy_stream: torch.cuda.Stream
    ready: list[torch.cuda.Event]
    free: list[torch.cuda.Event]
    pending_waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class LayerStreamer:
    """Streams the decoder layers of ``model`` chosen by ``settings`` (see the module docstring).

    Use :func:`enable_layer_streaming` to create one and :meth:`close` to restore a normal model.
    """

    def __init__(self, model: torch.nn.Module, settings: LayerStreamingConfig) -> None:
        if getattr(model, _STREAMER_ATTRIBUTE, None) is not None:
            raise InputError("layer streaming is already enabled on this model; close() it first")
        if any(isinstance(h, AlignDevicesHook) for m in model.modules() for h in _hooks_of(m)):
            raise InputError(
                "the model has accelerate device_map offload hooks; load it without device_map to stream its layers"
            )
        self.model = model
        self.settings = settings
        self.device = settings.target_device
        model_digest(model)  # the model's identity, from the real weights, before they move
        layers = decoder_layers(model)
        first, last = settings.keep_first_k, settings.keep_last_k
        if first + last > len(layers):
            raise ConfigError(
                f"keep_first_k + keep_last_k = {first + last} exceeds the model's {len(layers)} decoder layers"
            )
        layer_bytes = [layer_device_bytes(layer) for layer in layers]
        streamed_ids = {id(m) for layer in layers for m in layer.modules()}
        other_bytes = _unique_bytes(self._tensors_outside(streamed_ids))
        first = self._choose_keep_first(layer_bytes, other_bytes, first, len(layers) - last)
        streamed = list(range(first, len(layers) - last))
        pin = settings.pin_memory and self.device.type == "cuda"
        self.layers = [_StreamedLayer(i, layers[i], pin) for i in streamed]
        streamed_ids = {id(m) for layer in self.layers for m in layer.module.modules()}
        resident_bytes = self._move_resident(streamed_ids)
        num_slots, slot_size = self._allocate_slots()
        self._layer_slot: list[int | None] = [None] * len(self.layers)
        self._cursor = 0
        self._forward_bytes = 0
        self._stats = StreamingStats(
            streamed_layers=len(self.layers),
            resident_layers=len(layers) - len(self.layers),
            bytes_per_forward=sum(layer.tensor_bytes for layer in self.layers),
            resident_bytes=resident_bytes,
            slot_bytes=slot_size * num_slots,
        )
        self._hooks = [_StreamHook(self, order) for order in range(len(self.layers))]
        for layer, hook in zip(self.layers, self._hooks, strict=True):
            add_hook_to_module(layer.module, hook, append=True)
        setattr(model, _STREAMER_ATTRIBUTE, self)
        logger.info(
            "Streaming %d of %d decoder layers (%.1f MB per forward) through %d slots on %s; %.1f MB resident",
            len(self.layers),
            len(layers),
            self._stats.bytes_per_forward / 1e6,
            num_slots,
            self.device,
            resident_bytes / 1e6,
        )

    # ------------------------------------------------------------------ setup
    def _allocate_slots(self) -> tuple[int, int]:
        """Device slots (each as large as the largest streamed layer), every layer's views into each, their state
        and, on CUDA, the side stream and per-slot events; returns (slots, bytes per slot)."""
        num_slots = self.settings.num_slots if self.layers else 0
        slot_size = max((layer.nbytes for layer in self.layers), default=0)
        self.slots = [torch.empty(slot_size, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]
        for layer in self.layers:
            layer.slot_views = [layer.views(slot) for slot in self.slots]
        self._slot_state = [_SlotState() for _ in self.slots]
        self._cuda: _CudaSync | None = None
        if self.device.type == "cuda" and self.layers:
            self._cuda = _CudaSync(
                torch.cuda.Stream(self.device),
                [torch.cuda.Event() for _ in self.slots],
                [torch.cuda.Event() for _ in self.slots],
            )
        return num_slots, slot_size

    def _tensors_outside(self, streamed_ids: set[int]) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
        """Every place a tensor is held by a module that is not part of a streamed layer (shared tensors repeat)."""
        return [entry for m in self.model.modules() if id(m) not in streamed_ids for entry in _direct_tensors(m)]

    def _choose_keep_first(self, layer_bytes: list[int], other_bytes: int, first: int, stop: int) -> int:
        """``keep_first_k``, raised as far as the device budget allows (unchanged without a budget)."""
        budget = self.settings.device_memory_budget_bytes
        if budget is None:
            return first

        def need(keep: int) -> int:
            streamed = layer_bytes[keep:stop]
            slots = self.settings.num_slots * max(streamed, default=0)
            return other_bytes + sum(layer_bytes) - sum(streamed) + slots

        if need(first) > budget:
            raise CapacityError(
                f"device_memory_budget_bytes={budget} is below the {need(first)} bytes needed by the resident parts "
                f"and {self.settings.num_slots} slots; lower keep_first_k/keep_last_k/num_slots or raise the budget"
            )
        while first < stop and need(first + 1) <= budget:
            first += 1
        return first

    def _move_resident(self, streamed_ids: set[int]) -> int:
        """Move every tensor outside the streamed layers to the device; returns their bytes."""
        moved: dict[int, torch.Tensor] = {}  # shared (e.g. tied) tensors move once and stay shared
        for owner, name, kind, tensor in self._tensors_outside(streamed_ids):
            if id(tensor) not in moved:
                moved[id(tensor)] = tensor.data.to(self.device)
            _TensorRef(owner, name, kind, 0, (), tensor.dtype).bind(moved[id(tensor)])
        return sum(_tensor_bytes(t) for t in moved.values())

    # ------------------------------------------------------------------ hot path
    def _before_layer(self, order: int) -> None:
        if order == 0:
            self._start_forward()
        slot = self._layer_slot[order]
        if slot is None:
            slot = self._load(order, avoid=None)
            self._stats.reloads += 1
        self._wait_ready(slot)
        layer = self.layers[order]
        layer.bind(layer.slot_views[slot])
        self._slot_state[slot].running = True
        self._forward_bytes += layer.tensor_bytes
        self._stats.last_forward_bytes = self._forward_bytes
        following = (order + 1) % len(self.layers)
        if following != order and self._layer_slot[following] is None and len(self.slots) > 1:
            self._load(following, avoid=slot)

    def _after_layer(self, order: int) -> None:
        slot = self._layer_slot[order]
        if slot is None:
            return
        if not self.layers[order].verified:
            self._adopt(order, slot)
            self.layers[order].verified = True
        else:
            self._release(slot)

    def _start_forward(self) -> None:
        """A new forward: release slots of layers that raised, resolve finished wait timings."""
        for slot, state in enumerate(self._slot_state):
            if state.running and state.owner is not None:
                logger.debug("streamed layer %d did not return (exception); releasing its slot", state.owner)
                if self.layers[state.owner].verified:
                    self._release(slot)
                else:
                    self._adopt(state.owner, slot)
        self._stats.forwards += 1
        self._forward_bytes = 0
        if self._cuda is not None:
            self._resolve_waits(block=False)

    def _adopt(self, order: int, slot: int) -> None:
        """After a layer's first forward: if it created or replaced tensors (lazy repacking), pack its current
        tensors into a new host buffer (growing the slots if needed); then release its slot."""
        layer = self.layers[order]
        if not layer.changed(layer.slot_views[slot]):
            self._release(slot)
            return
        logger.debug("streamed layer %d changed its tensors in its first forward; repacking it", layer.index)
        self._release(slot, rebind=False)
        fresh = _StreamedLayer(layer.index, layer.module, layer.host.is_pinned())
        self.layers[order] = fresh
        if fresh.nbytes > self.slots[0].numel():
            self._grow_slots(fresh.nbytes)
        else:
            fresh.slot_views = [fresh.views(s) for s in self.slots]
        self._stats.bytes_per_forward = sum(x.tensor_bytes for x in self.layers)

    def _grow_slots(self, size: int) -> None:
        """Reallocate every slot with ``size`` bytes (rare: after a lazy repack grew a layer); drops prefetches."""
        if self._cuda is not None:
            self._cuda.copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        for slot in range(len(self.slots)):
            self._release(slot)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in self.slots]
        for layer in self.layers:
            layer.slot_views = [layer.views(s) for s in self.slots]
        self._stats.slot_bytes = size * len(self.slots)

    def _release(self, slot: int, rebind: bool = True) -> None:
        state = self._slot_state[slot]
        if self._cuda is not None:
            self._cuda.free[slot].record(torch.cuda.current_stream(self.device))
        if state.owner is not None:
            if rebind:
                self.layers[state.owner].bind(self.layers[state.owner].host_views)
            self._layer_slot[state.owner] = None
        state.owner, state.running = None, False

    def _load(self, order: int, avoid: int | None) -> int:
        """Copy streamed layer ``order`` into the next free slot (never ``avoid``); returns the slot."""
        slot = self._cursor
        if slot == avoid:
            slot = (slot + 1) % len(self.slots)
        self._cursor = (slot + 1) % len(self.slots)
        state = self._slot_state[slot]
        if state.owner is not None:  # an unused prefetch, or a layer that raised: its copy is dropped
            self._release(slot)
        layer = self.layers[order]
        target = self.slots[slot][: layer.nbytes]
        if self._cuda is not None:
            with torch.cuda.stream(self._cuda.copy_stream):
                self._cuda.copy_stream.wait_event(self._cuda.free[slot])
                target.copy_(layer.host, non_blocking=True)
                self._cuda.ready[slot].record(self._cuda.copy_stream)
        else:
            started = time.perf_counter()
            target.copy_(layer.host)
            self._stats.wait_seconds += time.perf_counter() - started
        state.owner = order
        self._layer_slot[order] = slot
        self._stats.loads += 1
        self._stats.bytes_streamed += layer.tensor_bytes
        return slot

    def _wait_ready(self, slot: int) -> None:
        """Make the compute stream wait for the slot's copy (CUDA; no host synchronisation)."""
        if self._cuda is None:
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(self._cuda.ready[slot])
        after.record(stream)
        self._cuda.pending_waits.append((before, after))

    def _resolve_waits(self, block: bool) -> None:
        """Add the measured waits of finished events to ``wait_seconds`` (``block``: synchronise first)."""
        assert self._cuda is not None, "only CUDA copies are timed with events"
        pending = self._cuda.pending_waits
        if block and pending:
            pending[-1][1].synchronize()
        done = 0
        while done < len(pending) and pending[done][1].query():
            before, after = pending[done]
            self._stats.wait_seconds += before.elapsed_time(after) / 1e3
            done += 1
        del pending[:done]

    # ------------------------------------------------------------------ public
    def stats(self, *, settle: bool = True) -> StreamingStats:
        """A snapshot of the counters. ``settle`` (from the thread running the model only): on CUDA, first wait for
        the pending copy timings and add them to ``wait_seconds``. ``settle=False`` reads the host-side counters
        only and touches no CUDA event, so any thread may call it while the model runs (``wait_seconds`` then
        lags by the waits of forwards whose events were still pending when the last forward began)."""
        if settle and self._cuda is not None:
            self._resolve_waits(block=True)
        return StreamingStats(**asdict(self._stats))

    @property
    def streamed_indices(self) -> list[int]:
        """Indices (in the decoder's layer list) of the streamed layers."""
        return [layer.index for layer in self.layers]

    @property
    def closed(self) -> bool:
        return getattr(self.model, _STREAMER_ATTRIBUTE, None) is not self

    def close(self, device: str | torch.device | None = None) -> None:
        """Stop streaming: the streamed layers get ordinary tensors on ``device`` (default: the compute device,
        i.e. a fully resident model) and the hooks are removed. Idempotent."""
        if self.closed:
            return
        if self._cuda is not None:
            self._cuda.copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        target = torch.device(device) if device is not None else self.device
        for slot in range(len(self.slots)):
            self._release(slot)
        for layer, hook in zip(self.layers, self._hooks, strict=True):
            _detach_hook(layer.module, hook)
            layer.bind([torch.empty_like(view, device=target).copy_(view) for view in layer.host_views])
        delattr(self.model, _STREAMER_ATTRIBUTE)
        self.layers, self.slots, self._hooks = [], [], []


def _hooks_of(module: torch.nn.Module) -> list[ModelHook]:
    """The accelerate hooks attached to ``module``, in order."""
    current = getattr(module, "_hf_hook", None)
    if current is None:
        return []
    return list(current.hooks) if isinstance(current, SequentialHook) else [current]


def _detach_hook(module: torch.nn.Module, hook: ModelHook) -> None:
    """Remove ``hook`` from ``module``, keeping any other accelerate hooks in their order."""
    others = [h for h in _hooks_of(module) if h is not hook]
    remove_hook_from_module(module)
    for other in others:
        add_hook_to_module(module, other, append=True)


def enable_layer_streaming(model: torch.nn.Module, settings: LayerStreamingConfig | None = None) -> LayerStreamer:
    """Stream ``model``'s decoder layers from host memory (see :class:`LayerStreamingConfig`); returns the handle.

    The model may sit on the CPU (the intended use: weights loaded into host memory) or on the device already.
    Everything that is not streamed is moved to ``settings.device``. Raises ArgumentTypeError for ``settings`` that
    are not a :class:`LayerStreamingConfig`.
    """
    if settings is not None and not isinstance(settings, LayerStreamingConfig):
        raise ArgumentTypeError(
            f"enable_layer_streaming takes a LayerStreamingConfig, got {type(settings).__name__}: write "
            f"enable_layer_streaming(model, LayerStreamingConfig(**{settings!r}))"
        )
    return LayerStreamer(model, settings or LayerStreamingConfig())


def layer_streamer(model: torch.nn.Module) -> LayerStreamer | None:
    """The active streamer of ``model``, or None."""
    return getattr(model, _STREAMER_ATTRIBUTE, None)


def disable_layer_streaming(model: torch.nn.Module, device: str | torch.device | None = None) -> None:
    """Close the active streamer of ``model`` (see :meth:`LayerStreamer.close`); a no-op without one."""
    streamer = layer_streamer(model)
    if streamer is not None:
        streamer.close(device)
