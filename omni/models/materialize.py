"""Weights for a model built on the meta device, written shard by shard.

Start-up builds the model on the meta device (no storage), splits and shards it there, and then
*materialises* each rank's part: ``materialize`` allocates the local tensors and asks a
``WeightSource`` for exactly the region of each full tensor the rank keeps (a DTensor's local
chunk, or the whole tensor for a plain one). No moment holds more than one parameter beyond the
rank's own share.

Sources:

- ``SeededInit``: random initialisation as a pure function of (seed, tensor name, shape), so
  every layout and the single-process run start from the same weights bit for bit. Which
  distribution a tensor gets is the model's business: the nearest module above it with an
  ``init_rule(owner, path, name)`` method answers with a rule (``Normal``, ``Fill``,
  ``Computed``); without one, the owning module's own ``reset_parameters`` (torch's defaults for
  Linear, LayerNorm, Conv, Embedding) runs on a host copy under a generator seeded from
  (seed, module name). ``Normal`` is generated in fixed blocks of rows, each from its own
  generator, so a rank that keeps rows a..b draws only the blocks it needs.
- ``TensorSource``: the tensors of an already materialised model (tests, small models).
- ``CheckpointSource`` (``omni.models.hf_io``): slices of a Hugging Face checkpoint.
- ``Sources``: by name prefix, the first that has the tensor.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

Index = tuple  # one slice per dimension of the full tensor

# Rows per generator block for Normal: about this many elements per block. Part of the weights'
# definition: changing it changes every initial weight.
_BLOCK_ELEMENTS = 1 << 20


def derive_seed(seed: int, *parts) -> int:
    """A 63-bit seed from ``seed`` and names: independent of the order tensors are visited in."""
    digest = hashlib.sha256(repr((int(seed), *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class Fill:
    value: float


@dataclass(frozen=True)
class Computed:
    """A deterministic full tensor (position tables, rotary frequencies): ``fn()`` on the host."""
    fn: Callable[[], torch.Tensor]


class WeightSource:
    """Where the values of a model's tensors come from."""

    def has(self, name: str) -> bool:
        return True

    def read(self, name: str, model: nn.Module, shape: torch.Size, index: Index) -> torch.Tensor:
        """Region ``index`` of the full tensor ``name`` (of ``shape``) of ``model``, on the host."""
        raise NotImplementedError


def full_index(shape: Sequence[int]) -> Index:
    return tuple(slice(0, int(n)) for n in shape)


def local_index(t: torch.Tensor) -> Index:
    """The region of the full tensor that this rank's part of ``t`` holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return full_index(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def named_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters and buffers, each once (a tied weight under its first name)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for _, t in named_tensors(module))


def default_device_is_meta() -> bool:
    """Inside ``with torch.device("meta")``: callers that want structure only."""
    return torch.empty(()).is_meta


@contextlib.contextmanager
def _keep_parameter_objects():
    """``to_empty`` swaps each tensor's contents instead of replacing the Parameter: references
    taken while the model was on meta (gradient syncs, FSDP's own) stay valid."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@torch.no_grad()
def materialize(modules: Sequence[nn.Module], source: WeightSource, device: torch.device | str) -> None:
    """Give every tensor of ``modules`` (built on meta, possibly split and sharded) storage on
    ``device`` and this rank's values from ``source``. The full names are the modules' own
    (``llm.layers.3.mlp.up_proj.weight``), which no layout changes."""
    for module in modules:
        with _keep_parameter_objects():
            module.to_empty(device=device)
        for name, t in named_tensors(module):
            index = local_index(t)
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.numel() == 0:
                continue
            with torch.device("cpu"):  # sources work on the host, whatever the default device
                value = source.read(name, module, t.shape, index)
            if tuple(value.shape) != tuple(local.shape):
                raise RuntimeError(f"weights for {name}: got a region of shape {tuple(value.shape)}, "
                                   f"this rank holds {tuple(local.shape)}")
            local.copy_(value)


@torch.no_grad()
def fill_meta(module: nn.Module, source: WeightSource) -> None:
    """Host tensors from ``source`` for whatever ``module`` still has on meta (after
    ``load_state_dict(assign=True)``: the buffers no state dict holds)."""
    for name, t in list(named_tensors(module)):
        if not t.is_meta:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        with torch.device("cpu"):
            value = source.read(name, module, t.shape, full_index(t.shape)).to(t.dtype)
        if attr in owner._buffers:
            owner._buffers[attr] = value
        else:
            owner._parameters[attr] = nn.Parameter(value, requires_grad=t.requires_grad)


# ------------------------------------------------------------------------------ sources


class TensorSource(WeightSource):
    """Values of an already materialised model (or any name -> full tensor mapping)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @classmethod
    def of(cls, model: nn.Module) -> "TensorSource":
        return cls({name: t.detach() for name, t in named_tensors(model)})

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name, model, shape, index):
        return self.tensors[name][index]


class Sources(WeightSource):
    """The first source whose prefix matches and that has the tensor (names are passed on
    without the prefix); ``default`` for the rest."""

    def __init__(self, prefixed: Sequence[tuple[str, WeightSource]], default: WeightSource):
        self.prefixed, self.default = list(prefixed), default

    def read(self, name, model, shape, index):
        for prefix, src in self.prefixed:
            if name.startswith(prefix) and src.has(name[len(prefix):]):
                return src.read(name[len(prefix):], model, shape, index)
        return self.default.read(name, model, shape, index)


class SeededInit(WeightSource):
    """Random initial weights, a pure function of (seed, name, shape); see the module doc."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    def read(self, name, model, shape, index):
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        rule = _rule(model, owner_path, owner, attr)
        if isinstance(rule, Normal):
            return _normal_region(derive_seed(self.seed, name), shape, rule, index)
        if isinstance(rule, Fill):
            return torch.full(tuple(s.stop - s.start for s in index), float(rule.value))
        if isinstance(rule, Computed):
            return rule.fn()[index]
        return _module_default(owner, owner_path, attr, shape, derive_seed(self.seed, owner_path), model)[index]


def _rule(model: nn.Module, owner_path: str, owner: nn.Module, attr: str):
    """The answer of the nearest module above the tensor (its owner included) with ``init_rule``."""
    parts = owner_path.split(".") if owner_path else []
    for depth in range(len(parts), -1, -1):
        ancestor = model.get_submodule(".".join(parts[:depth]))
        ask = getattr(ancestor, "init_rule", None)
        if ask is not None:
            rule = ask(owner, ".".join(parts[depth:]), attr)
            if rule is not None:
                return rule
    return None


def _normal_region(seed: int, shape: torch.Size, rule: Normal, index: Index) -> torch.Tensor:
    """Rows ``index[0]`` of a normal tensor drawn block by block (``_BLOCK_ELEMENTS``)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        g = torch.Generator().manual_seed(seed)
        return torch.empty(()).normal_(rule.mean, rule.std, generator=g)
    row = math.prod(shape[1:])
    per = max(1, _BLOCK_ELEMENTS // max(1, row))
    lo, hi = index[0].start, index[0].stop
    parts = []
    for b in range(lo // per, -(-hi // per)):
        start, stop = b * per, min(shape[0], (b + 1) * per)
        g = torch.Generator().manual_seed(seed + b)
        block = torch.empty((stop - start, *shape[1:])).normal_(rule.mean, rule.std, generator=g)
        parts.append(block[max(lo, start) - start: min(hi, stop) - start][(slice(None), *index[1:])])
    if not parts:
        return torch.empty((0, *(s.stop - s.start for s in index[1:])))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _module_default(owner: nn.Module, owner_path: str, attr: str, shape, seed: int, model: nn.Module) -> torch.Tensor:
    """The owning module's own initialisation, run on a host copy with full-size tensors (one
    module's tensors at a time), under a generator seeded from its name. A module without
    ``reset_parameters`` inside an encoder: the encoder is built afresh on the host (its
    constructor is its initialisation) and the tensor taken from it."""
    reset = getattr(owner, "reset_parameters", None)
    if reset is not None:
        host = copy.copy(owner)  # shallow: the original keeps its own tensors
        host._parameters = {k: None if p is None else nn.Parameter(torch.empty(_full_shape(owner, k)),
                                                                    requires_grad=False)
                            for k, p in owner._parameters.items()}
        host._buffers = {k: None if b is None else torch.empty(_full_shape(owner, k), dtype=b.dtype)
                         for k, b in owner._buffers.items()}
        host._modules = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            type(owner).reset_parameters(host)
        return getattr(host, attr).detach()
    anchor_path, anchor = _enclosing_encoder(model, owner_path)
    if anchor is None:
        raise ValueError(f"no initialisation known for {owner_path}.{attr} ({type(owner).__name__}): give the "
                         f"module a reset_parameters() or an enclosing module an init_rule()")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "encoder", anchor_path))
        with torch.device("cpu"):
            fresh = type(anchor)(anchor.config)
    rel = f"{owner_path}.{attr}"[len(anchor_path) + 1:] if anchor_path else f"{owner_path}.{attr}"
    return dict(named_tensors(fresh))[rel].detach()


def _full_shape(module: nn.Module, key: str) -> torch.Size:
    t = module._parameters.get(key)
    if t is None:
        t = module._buffers[key]
    return t.shape  # a DTensor's shape is the full one


def _enclosing_encoder(model: nn.Module, path: str) -> tuple[str, Optional[nn.Module]]:
    from omni.models.encoders.base import EncoderAnchor

    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:depth]))
        if isinstance(m, EncoderAnchor):
            return ".".join(parts[:depth]), m
    return "", None
