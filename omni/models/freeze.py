"""The model's modules by name, and freezing them for a whole run.

Three settings name modules: ``model.freeze`` (frozen for the whole run), ``trainer.stages``
(what trains in each stage) and ``optim.groups`` (a module's lr and weight decay). They share
this one vocabulary:

- ``llm``: the language model;
- ``encoder.<slot>`` / ``projector.<slot>``: one encoder slot's tower / projector (the slots are
  the keys of ``encoders``, e.g. ``vision``; ``encoders.<slot>`` is the same name);
- ``encoders`` / ``projectors`` (or ``encoder`` / ``projector``): every slot's;
- ``all`` (``trainer.stages`` only): every module ``model.freeze`` leaves trainable.

The finest names (``llm``, ``encoder.<slot>``, ``projector.<slot>``) are the *units*; every
other name stands for a set of them. A parameter's unit is read off its name, which is the
unsplit model's under every layout (``llm.…``, ``encoders.<modality>.…``,
``projectors.<modality>.…``): the same rule holds on a pipeline chunk, an FSDP shard, a TP
DTensor and the multiplexer's media tower.

Freezing sets ``requires_grad=False`` on the meta model before it is parallelized (and after
adapters are injected), so FSDP, TP, the pipeline and the multiplexer all see it: a frozen
module has no gradients and no optimizer state, and a frozen encoder runs no backward.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Sequence

from torch import nn

ALL = "all"
LLM = "llm"
# Names standing for every slot's tower / projector, and the unit prefix they expand to.
_EVERY = {"encoders": "encoder", "encoder": "encoder", "projectors": "projector", "projector": "projector"}
# The parameter-name head of each kind of unit.
_HEADS = {"encoder": "encoders", "projector": "projectors"}


class ModuleNames:
    """The module vocabulary of one model: ``slots`` maps each encoder slot (the user's label,
    a key of ``encoders``) to the modality the model keys its encoder by."""

    def __init__(self, slots: Mapping[str, str]):
        self.slots = dict(slots)
        self._slot_of = {modality: slot for slot, modality in self.slots.items()}
        self.units = [LLM, *(f"encoder.{s}" for s in self.slots), *(f"projector.{s}" for s in self.slots)]

    @classmethod
    def of_config(cls, slots: Mapping) -> "ModuleNames":
        """From the ``encoders`` config (slot -> EncoderSlot), without building anything: each
        plugin class states its modality."""
        from omni.models.encoders.registry import get_encoder_class

        return cls({name: get_encoder_class(slot._target_ or slot.name).modality for name, slot in slots.items()})

    @classmethod
    def of_parameters(cls, names: Iterable[str]) -> "ModuleNames":
        """For a model built without a config (tests, tools): each slot named after its modality."""
        modalities = sorted({n.split(".")[1] for n in names if n.startswith(("encoders.", "projectors."))})
        return cls({m: m for m in modalities})

    # -- names -----------------------------------------------------------------------------
    def names(self, with_all: bool = False) -> list[str]:
        """The names a user may write (canonical spellings)."""
        return [*([ALL] if with_all else []), LLM, "encoders", "projectors", *self.units[1:]]

    def expand(self, name: str) -> frozenset[str]:
        """The units ``name`` stands for; ValueError for a name that is none of them."""
        if name == LLM:
            return frozenset([LLM])
        if name == ALL:
            return frozenset(self.units)
        if name in _EVERY:
            return frozenset(u for u in self.units if u.startswith(_EVERY[name] + "."))
        kind, _, slot = name.partition(".")
        kind = _EVERY.get(kind)
        if kind is not None and slot in self.slots:
            return frozenset([f"{kind}.{slot}"])
        raise ValueError(name)

    def resolve(self, key: str, names: Sequence[str], with_all: bool = False) -> frozenset[str]:
        """The units ``names`` (the value of config key ``key``) stand for together, or one
        ValueError line naming the unknown name and the valid ones."""
        out: set[str] = set()
        for name in names:
            try:
                if name == ALL and not with_all:
                    raise ValueError(name)
                out |= self.expand(str(name))
            except ValueError:
                valid = self.names(with_all)
                close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"{key}: {name!r} names no module of this model{hint}; the modules are "
                                 f"{', '.join(valid)} (slots are the keys of encoders)") from None
        return frozenset(out)

    def unit_of(self, param_name: str) -> str | None:
        """The unit holding the parameter ``param_name`` (None: outside every unit)."""
        head, _, rest = param_name.partition(".")
        if head == LLM:
            return LLM
        for kind, prefix in _HEADS.items():
            if head == prefix:
                slot = self._slot_of.get(rest.split(".", 1)[0])
                return None if slot is None else f"{kind}.{slot}"
        return None

    def describe(self, units: Iterable[str]) -> str:
        """``units`` as a short list in the vocabulary's order."""
        chosen = set(units)
        return ", ".join(u for u in self.units if u in chosen) or "nothing"


def frozen_names(freeze: Sequence[str], slots: Mapping) -> list[str]:
    """``model.freeze`` plus ``encoder.<slot>`` for every slot whose own ``freeze`` is set."""
    return [*freeze, *(f"encoder.{name}" for name, slot in slots.items() if getattr(slot, "freeze", False))]


def frozen_units(names: ModuleNames, freeze: Sequence[str], slots: Mapping) -> frozenset[str]:
    """The units frozen for the whole run; ValueError for an unknown name, or when nothing
    would be left to train."""
    units = names.resolve("model.freeze", frozen_names(freeze, slots))
    if units and units >= set(names.units):
        raise ValueError(f"model.freeze={list(freeze)} freezes every module ({names.describe(units)}): nothing would "
                         "train; leave at least one module out")
    return units


def freeze(model: nn.Module, names: ModuleNames, units: Iterable[str]) -> None:
    """``requires_grad=False`` on every parameter of ``units`` (on the meta model, before it
    is parallelized)."""
    units = set(units)
    for name, p in model.named_parameters():
        if names.unit_of(name) in units:
            p.requires_grad_(False)
