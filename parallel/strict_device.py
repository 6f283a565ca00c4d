"""The strict device check: on the CPU, under CUDA's rules, a host read of a tensor that a GPU
would hold raises with its call site, and the host syncs a step makes are counted.

On the CPU the device *is* the host, so reading a tensor back costs nothing and nothing
notices the code that, on a GPU, waits for the device (``.item()``, ``.tolist()``, a boolean
mask, ``nonzero``) or copies pageable memory in the middle of a step. This check tracks which
tensors live on the "device":

- the model's parameters and buffers (``mark_module``), the inputs moved by
  ``parallel.transfer.to_device`` (``mark``), and every tensor computed from one of them
  (forward, backward, collectives, optimizer state: a dispatch mode follows each op);
- inside the *device window* (``device_window``: the step's forward, backward, gradient sync
  and optimizer), a tensor made by a factory with an explicit ``device=`` (``torch.zeros(n,
  device=x.device)``) or inside an op's implementation; one made without a device
  (``torch.tensor(rows)``) is a host tensor, as it would be on a GPU, and so is everything
  made outside the window and everything computed from host tensors alone. A tensor made
  before the check began (the data plane's batch, FSDP's internal buffers) is neither: it is
  not refused, and a copy of it into the window is.

and raises ``HostSyncError`` when the host reads one (``item``, ``tolist``, ``numpy``,
``cpu``, ``bool``/``int``/``float`` of it, a copy into a host tensor, or an op whose output
size depends on its values: ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``, ``bincount``), when the window copies host data
to the device (``torch.tensor(data, device=...)``, ``host.to(device)``: a pageable copy, which
waits for the host), or when an op mixes a device tensor with a host tensor that is not a
0-dim scalar (CUDA raises, or copies implicitly). A read the step needs is declared with
``host_read(reason)``: it is counted (``syncs``), not refused.

What it cannot see: device choices made from ``tensor.device`` (every tensor here is on the
CPU; those go through ``parallel.device_rules``), and stream semantics (a non-blocking copy is
done when it returns). It costs a Python call per op: tests and ``trainer.device_rules=cuda``
runs only.
"""
from __future__ import annotations

import collections
import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode

_MARK = "_omni_on_device"
aten = torch.ops.aten
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS = os.path.abspath(__file__)

# Ops whose output size, or whose result, the host must read from the device.
_SYNC_OPS = {aten._local_scalar_dense.default: "item/int/float/bool", aten.nonzero.default: "nonzero",
             aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
             aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique_consecutive",
             aten.bincount.default: "bincount", aten.equal.default: "torch.equal", aten.is_nonzero.default: "bool",
             aten.argwhere.default: "argwhere"}
_READ_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu",
                 torch.Tensor.__array__: "numpy"}
# Factories that copy host data (a list, an array) into a tensor.
_FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
              torch.randint, torch.linspace, torch.eye, torch.empty_strided, torch.randperm} | _FROM_HOST


class HostSyncError(RuntimeError):
    """The host read a tensor that would live on the GPU, outside a declared read."""


def on_device(t) -> bool:
    """Whether ``t`` lives on the device: a GPU tensor, or one the strict check tracks."""
    return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or getattr(t, _MARK, None) is True)


def _on_host(t) -> bool:
    """Known to be a host tensor (made on the host under the check); unknown is neither."""
    return getattr(t, _MARK, None) is False


def active() -> "StrictDevice | None":
    """The strict check this thread runs under (None: none)."""
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, _FunctionMode):
            return mode.strict
    return None


def mark_copied(t: torch.Tensor, copy: bool = False) -> None:
    """``t`` now lives on the (emulated) device: a batched host-to-device copy made it
    (``parallel.transfer``); ``copy``: count it as one copy of the step."""
    _mark(t)
    strict = active()
    if strict is not None and copy:
        strict.copies += 1


@contextlib.contextmanager
def host_read(reason: str):
    """A read of device data that the code needs (the step's losses, expert-parallel split
    sizes): counted as a sync named ``reason`` under the strict check, nothing otherwise."""
    strict = active()
    if strict is None:
        yield
        return
    with strict.allowed(reason):
        yield


def _call_site() -> str:
    """The innermost frame of this repository's code outside this file."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path.startswith(_REPO) and path != _THIS and "/.venv/" not in path and "/site-packages/" not in path:
            return f"{os.path.relpath(path, _REPO)}:{frame.lineno} in {frame.name}"
    return "outside this repository"


def _leaves(tree, out: list | None = None) -> list:
    """The leaves of an op's arguments or results: tensors, nested in tuples, lists and dicts
    (all a dispatched op takes or returns). Hand-rolled because it runs on every op of a strict
    step, where ``torch.utils._pytree.tree_leaves`` was a fifth of the step's time."""
    out = [] if out is None else out
    for x in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else (tree,):
        if isinstance(x, (tuple, list, dict)):
            _leaves(x, out)
        else:
            out.append(x)
    return out


def _mark(tree, device: bool = True) -> None:
    for t in _leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            try:
                setattr(t, _MARK, device)
            except (AttributeError, RuntimeError):  # an immutable wrapper: its users are marked instead
                pass


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in _leaves(tree) if isinstance(t, torch.Tensor)]


class StrictDevice:
    """Enter it (a context manager) around what runs the step; see the module docstring."""

    def __init__(self, raise_on_violation: bool = True):
        self.raise_on_violation = raise_on_violation
        self.syncs: collections.Counter = collections.Counter()  # declared reads, this step
        self.violations: list[str] = []  # when not raising
        self.copies = 0  # batched host-to-device copies (parallel.transfer), this step
        self.window = 0
        self._allowed: list[str] = []
        self._host_factory = 0
        self._depth = 0
        self._fn = _FunctionMode(self)
        self._dispatch = _DispatchMode(self)

    # -- setup ------------------------------------------------------------------------------
    def mark(self, *tensors) -> None:
        _mark(tensors)

    def mark_module(self, module: torch.nn.Module) -> None:
        """Its parameters and buffers live on the device (a DTensor's local shard too)."""
        for t in list(module.parameters()) + list(module.buffers()):
            _mark(t)
            local = getattr(t, "_local_tensor", None)
            if local is not None:
                _mark(local)

    def begin_step(self) -> None:
        self.syncs.clear()
        self.copies = 0

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    # -- regions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def device_window(self):
        """The step's device work: factories with a device make device tensors here, and host
        data copied into the device is refused."""
        self.window += 1
        try:
            yield
        finally:
            self.window -= 1

    @contextlib.contextmanager
    def outside_window(self):
        """Host work done while the device runs the step (the next step's inputs): as outside
        the window (factories make host tensors; copies go through ``parallel.transfer``)."""
        saved, self.window = self.window, 0
        try:
            yield
        finally:
            self.window = saved

    @contextlib.contextmanager
    def allowed(self, reason: str):
        self._allowed.append(reason)
        try:
            yield
        finally:
            self._allowed.pop()

    def __enter__(self) -> "StrictDevice":
        """Re-entrant: a step entered while the run's loop already is (the data feed's work
        and the step's alike) keeps the one pair of modes."""
        self._depth += 1
        if self._depth == 1:
            self._fn.__enter__()
            self._dispatch.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            self._dispatch.__exit__(*exc)
            self._fn.__exit__(*exc)
        return False

    # -- findings ---------------------------------------------------------------------------
    def _read(self, what: str) -> None:
        if self._allowed:
            self.syncs[self._allowed[-1]] += 1
            return
        self._violation(f"host read of a device tensor ({what})", "on a GPU the host waits for the device here; "
                        "keep the value on the device, or compute it on the host before the step")

    def _violation(self, what: str, why: str) -> None:
        line = f"strict device check: {what} at {_call_site()}: {why}"
        if self.raise_on_violation:
            raise HostSyncError(line)
        self.violations.append(line)


class _Reporting:
    """What both modes share: the ``StrictDevice`` they report to (a mixin before the torch mode
    class, whose ``__init__`` it then calls)."""

    def __init__(self, strict: StrictDevice):
        super().__init__()
        self.strict = strict


class _FunctionMode(_Reporting, TorchFunctionMode):
    """Python-level calls: host reads that never reach the dispatcher (``tolist``, ``numpy``),
    and factories, whose ``device=`` says where their result goes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.strict
        what = _READ_METHODS.get(func)
        if what is not None and args and on_device(args[0]):
            s._read(what)
        if func in _FACTORIES:
            given = kwargs.get("device") is not None
            if s.window and given and func in _FROM_HOST and not isinstance(args[0] if args else None, torch.Tensor):
                if s._allowed:
                    s.syncs[s._allowed[-1]] += 1
                else:
                    s._violation(f"{func.__name__}(host data, device=...) inside the step",
                                 "a pageable host-to-device copy; build it on the host before the step and move it "
                                 "with the step's inputs (parallel.transfer.to_device)")
            if not (s.window and given):
                s._host_factory += 1
                try:
                    out = func(*args, **kwargs)
                finally:
                    s._host_factory -= 1
                _mark(out, device=False)
                return out
            out = func(*args, **kwargs)
            _mark(out)
            return out
        if s.window and func is torch.Tensor.new_tensor and args and on_device(args[0]) and not s._allowed \
                and not isinstance(args[1] if len(args) > 1 else kwargs.get("data"), torch.Tensor):
            s._violation("device_tensor.new_tensor(host data) inside the step",
                         "a pageable host-to-device copy; build it on the host before the step and move it with the "
                         "step's inputs (parallel.transfer.to_device)")
        if s.window and func in (torch.Tensor.to, torch.Tensor.cuda) and args and _moves_host_to_device(func, args,
                                                                                                         kwargs):
            if not s._allowed:
                s._violation("host tensor copied to the device inside the step",
                             "a pageable host-to-device copy; move it with the step's inputs "
                             "(parallel.transfer.to_device) before the step")
            out = func(*args, **kwargs)
            if out is args[0]:  # a copy on a GPU: a tensor of its own here too, or the host one would be marked
                out = out.clone()
            _mark(out)
            return out
        return func(*args, **kwargs)


def _moves_host_to_device(func, args, kwargs) -> bool:
    """``t.to(device)`` / ``t.cuda()`` of a host tensor with elements (a device argument, not a
    dtype alone)."""
    t = args[0]
    if not isinstance(t, torch.Tensor) or on_device(t) or t.numel() == 0:
        return False
    if func is torch.Tensor.cuda:
        return True
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(a, (str, torch.device)) or (isinstance(a, torch.Tensor) and on_device(a)) for a in targets
               if a is not None)


class _DispatchMode(_Reporting, TorchDispatchMode):
    """Every op, forward and backward: marks follow the data, and the ops that wait for the
    device are caught."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.strict
        inputs = _tensors((args, kwargs))
        device_in = [t for t in inputs if on_device(t)]
        if device_in:
            what = _SYNC_OPS.get(func)
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                what = "repeat_interleave without output_size"
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                what = "boolean-mask indexing"
            if what is not None:
                s._read(what)
            if func in (aten.copy_.default,) and not on_device(args[0]) and on_device(args[1]):
                s._read("device-to-host copy")
            elif s.window and not s._allowed:
                host = [t for t in inputs if _on_host(t) and t.dim() > 0 and t.numel() > 0]
                if host and func not in _SHAPE_ONLY:
                    s._violation(f"{func} mixes a device tensor with a host tensor of shape {tuple(host[0].shape)}",
                                 "on CUDA this raises or copies implicitly; create it on the device, or move it "
                                 "with the step's inputs")
        out = func(*args, **kwargs)
        if device_in or (not inputs and s.window and not s._host_factory):
            _mark(out)
        elif (not inputs and s._host_factory) or (inputs and any(_on_host(t) for t in inputs)) or not s.window:
            # made on the host, from host tensors, or outside the step's device work
            _mark(out, device=False)
        return out


# Ops that read only shapes, strides or dtypes of their tensor arguments (never values).
_SHAPE_ONLY = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.new_empty.default,
               aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.detach.default,
               aten.alias.default, aten.view.default, aten._unsafe_view.default}
