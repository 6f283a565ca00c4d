"""Activation offloading: what autograd saves inside chosen blocks goes to pinned host memory during
the forward and comes back ahead of the block's backward (``parallel.activation_offload``).

Each chosen block's forward runs under ``saved_tensors_hooks``: a saved tensor on the GPU (not a
parameter, not smaller than ``min_bytes``) is copied to a pinned host buffer on a side stream, and
autograd keeps the handle instead, so the device memory is freed once the forward is done with it.
The backward brings the blocks back one ahead: the first time a block's backward unpacks a tensor,
the copies of the offloaded block run before it in the same forward are issued on the side stream,
so they overlap this block's backward; a tensor not prefetched is copied back when unpacked. The
compute stream waits for a copy only where it uses the tensor (CUDA events).

Recompute composes: a checkpointed block saves only its inputs, and those are what is offloaded.
On the CPU the device is the host, so nothing moves (``emulate`` copies anyway, for the tests that
check the bookkeeping: which tensors, in which order, prefetched when).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

MIN_BYTES = 1 << 16  # smaller tensors (per-token statistics, indices) are not worth a copy each


@dataclass
class _Saved:
    host: torch.Tensor
    device: torch.device
    done: object = None  # the event after which ``host`` is complete (CUDA)
    back: torch.Tensor | None = None  # the prefetched device copy
    ready: object = None  # the event after which ``back`` is complete (CUDA)


@dataclass
class _Group:
    """One block's saved tensors of one forward."""

    index: int
    prev: _Group | None
    saved: list[_Saved] = field(default_factory=list)
    prefetched: bool = False


class ActivationOffload:
    """``layers``: the block indices whose saved activations go to the host (None: all blocks).
    ``emulate``: copy on the CPU too (tests). One per model; not thread-safe."""

    def __init__(self, layers: set[int] | None = None, min_bytes: int = MIN_BYTES, emulate: bool = False):
        self.layers = layers
        self.min_bytes = min_bytes
        self.emulate = emulate
        self._last: _Group | None = None
        self._stream = None
        self.log: list[tuple[str, int]] | None = None  # (event, block index) when a test sets a list

    def applies(self, index: int) -> bool:
        return torch.is_grad_enabled() and (self.layers is None or index in self.layers)

    @contextlib.contextmanager
    def block(self, index: int):
        """Run one block's forward inside this: its saved tensors are offloaded."""
        prev = self._last if self._last is not None and self._last.index < index else None
        group = _Group(index, prev)  # a lower index than the last: a new forward (micro-batch)
        self._last = group
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t),
                                                      lambda s: self._unpack(group, s)):
            yield

    # -- forward

    def _moves(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return False  # weights stay (their gradient is accumulated into them)
        if t.device.type == "cpu" and not self.emulate:
            return False  # the device is the host
        return t.untyped_storage().nbytes() >= self.min_bytes

    def _pack(self, group: _Group, t: torch.Tensor):
        if not self._moves(t):
            return t
        if t.is_cuda:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            t.record_stream(stream)  # the allocator keeps t until the copy has read it
            saved = _Saved(host, t.device, done)
        else:
            saved = _Saved(t.detach().clone(), t.device)
        group.saved.append(saved)
        if self.log is not None:
            self.log.append(("offload", group.index))
        return saved

    # -- backward

    def _unpack(self, group: _Group, s):
        if not isinstance(s, _Saved):
            return s
        if not group.prefetched:
            group.prefetched = True
            if group.prev is not None:
                self._prefetch(group.prev)
        if s.back is None:
            self._bring_back(group, s)
        elif s.ready is not None:
            torch.cuda.current_stream(s.device).wait_event(s.ready)
        out, s.back = s.back, None  # autograd unpacks each saved tensor once
        return out

    def _prefetch(self, group: _Group) -> None:
        if self.log is not None:
            self.log.append(("prefetch", group.index))
        for s in group.saved:
            if s.back is None:
                self._bring_back(group, s, ahead=True)

    def _bring_back(self, group: _Group, s: _Saved, ahead: bool = False) -> None:
        if s.host.device.type == "cpu" and s.device.type == "cuda":
            stream = self._side_stream(s.device)
            if ahead:
                stream.wait_stream(torch.cuda.current_stream(s.device))
            with torch.cuda.stream(stream):
                stream.wait_event(s.done)
                s.back = s.host.to(s.device, non_blocking=True)
                s.ready = torch.cuda.Event()
                s.ready.record(stream)
            s.back.record_stream(torch.cuda.current_stream(s.device))
            if not ahead:  # needed now: the compute stream waits for it
                torch.cuda.current_stream(s.device).wait_event(s.ready)
                s.ready = None
        else:
            s.back = s.host.clone()
        if self.log is not None and not ahead:
            self.log.append(("late", group.index))

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
