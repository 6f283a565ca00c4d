"""LoRA (``model.lora``): peft's adapters on the native linear layers of the LLM and the encoders.

``inject`` wraps each target ``nn.Linear`` of the adapted parts in peft's ``lora.Linear``
(``peft.inject_adapter_in_model``): the output becomes ``base(x) + B(A(dropout(x))) * alpha / r``
and every other tensor of an adapted part is frozen (peft's rule; projectors and the parts left
out still train unless frozen). It runs on the meta device right after the model is built,
before freezing and parallelism (``omni.models.build.build_meta_model``).

Names. peft moves a wrapped layer's weight to ``<layer>.base_layer.weight`` and adds
``<layer>.lora_A.default.weight`` [r, in] and ``<layer>.lora_B.default.weight`` [out, r].
Checkpoints keep these names (the same on every layout, and the run's config rebuilds the
same model for resume, ``omni export`` and ``omni generate``). The weight sources see the
original names (``LoraWeights``): a Hugging Face checkpoint and the seeded initialisation give
a base weight exactly what they give the unadapted model; A starts as peft draws it (Kaiming
uniform, from the seed and the tensor's name), B at zero, so training starts from the base
model's outputs. ``merge`` folds the adapters into the base weights and puts the plain layers
back, which is what ``omni export`` writes (``write_peft_adapter`` writes them as a peft adapter
folder instead).

Tensor parallelism (``tensor_parallel_plan``, called by the decoder's plan). A column-parallel
layer: base and B column-parallel, A replicated (its input is the full row every TP rank
holds; the partial gradient of A's output is all-reduced by B's input, as for the base's
input). A row-parallel layer: A row-parallel like the base (its input is the head- or
hidden-sharded activation), its partial [tokens, r] output reduce-scattered to the base's
sequence shards (r columns: far cheaper than gathering the input), then B replicated on those
shards; B's gradient is then a partial sum per rank, summed like the norms' (``sync_gradients``).
"""
from __future__ import annotations

import contextlib
import math
import re
import sys
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from omni.errors import ConfigError, UserError
from omni.models.config import LoraConfig
from omni.models.materialize import WeightSource, derive_seed

ADAPTER = "default"  # peft's adapter name: part of the checkpoint names
ALL_LINEAR = "all-linear"
_BASE = ".base_layer"
_LORA = re.compile(r"\.lora_([AB])\.%s\.weight$" % ADAPTER)


def _peft():
    try:
        import peft
    except ImportError:
        raise UserError("model.lora.rank > 0 needs peft: pip install 'omni-mm[lora]' (or set model.lora.rank=0)") \
            from None
    return peft


def check(cfg: LoraConfig, slots: Iterable[str]) -> None:
    """``model.lora``'s values against the encoder slots (their names), before anything is built."""
    if not isinstance(cfg.rank, int) or cfg.rank < 0:
        raise ConfigError(f"model.lora.rank={cfg.rank!r} must be an integer >= 0 (0: no LoRA)")
    if cfg.rank == 0:
        return
    if not cfg.alpha > 0:
        raise ConfigError(f"model.lora.alpha={cfg.alpha!r} must be > 0 (the adapters' scale is alpha / rank)")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={cfg.dropout!r} must be in [0, 1)")
    if not cfg.targets:
        raise ConfigError("model.lora.targets is empty; name the linear layers to adapt (e.g. [q_proj,v_proj]) "
                          "or [all-linear]")
    if not cfg.modules:
        raise ConfigError("model.lora.modules is empty; name the parts to adapt: llm, encoders, encoder.<slot>")
    parts(cfg, {slot: slot for slot in slots})  # which modality a slot holds does not matter here
    _peft()


def parts(cfg: LoraConfig, slot_modality: Mapping[str, str]) -> dict[str, str]:
    """The parts ``cfg.modules`` names, in the module vocabulary of ``model.freeze``
    (``omni.models.freeze``: ``llm``, ``encoders``, ``encoder.<slot>`` / ``encoders.<slot>``):
    unit -> the module's path in ``OmniModel`` (``encoders.image``: the model keys encoders by
    modality). Projectors are refused: they train fully."""
    from omni.models.freeze import LLM, ModuleNames

    names = ModuleNames(slot_modality)
    try:
        units = names.resolve("model.lora.modules", cfg.modules)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out: dict[str, str] = {}
    for unit in (u for u in names.units if u in units):
        kind, _, slot = unit.partition(".")
        if kind == "projector":
            raise ConfigError(f"model.lora.modules: {unit} is a projector; LoRA adapts the llm and the encoders "
                              "(projectors train fully unless frozen)")
        out[unit] = "llm" if unit == LLM else f"encoders.{slot_modality[slot]}"
    return out


def inject(model: nn.Module, cfg: LoraConfig, slot_modality: Mapping[str, str]) -> None:
    """Adapters on ``cfg.targets`` of every part ``cfg.modules`` names (in place; the model may
    be on the meta device). Each part's other tensors are frozen."""
    if cfg.rank == 0:
        return
    peft = _peft()
    for label, path in parts(cfg, slot_modality).items():
        module = model.get_submodule(path)
        linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and not _is_head(n)]
        targets = linears if ALL_LINEAR in cfg.targets else list(cfg.targets)
        config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
        try:
            with torch.device("meta") if _on_meta(module) else contextlib.nullcontext():
                peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER)
        except ValueError as exc:
            if "not found in the base model" not in str(exc):
                raise
            raise ConfigError(f"model.lora.targets={list(cfg.targets)} matches no linear layer of {label} (its "
                              f"linear layers: {', '.join(leaves)}); name some of them, or use [{ALL_LINEAR}]") \
                from None
        for name, layer in adapted_layers(module).items():
            base = layer.get_base_layer()
            if _is_head(name) or not isinstance(base, nn.Linear):
                # The head is read as a matrix (Decoder.lm_logits), never called: an adapter
                # there would be skipped.
                what = "the LM head" if _is_head(name) else f"a {type(base).__name__}"
                raise ConfigError(f"model.lora.targets: {label}.{name} is {what}; LoRA adapts the linear layers "
                                  f"a part calls ({', '.join(leaves)})")


def _is_head(name: str) -> bool:
    return name == "lm_head" or name.endswith(".lm_head")


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _is_lora(module: nn.Module) -> bool:
    # A process that never imported peft holds no peft layer: answering without importing it
    # spares every rank of a TP run without LoRA peft's (and transformers') ~3 s import.
    if "peft" not in sys.modules:
        return False
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: nothing can be adapted
        return False
    return isinstance(module, LoraLayer)


def adapted_layers(module: nn.Module) -> dict:
    """path -> peft LoRA layer, for every adapted layer under ``module``."""
    return {n: m for n, m in module.named_modules() if _is_lora(m)}


def is_adapted(model: nn.Module) -> bool:
    return bool(adapted_layers(model))


def base_name(name: str) -> str:
    """A tensor's name in the unadapted model (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(_BASE + ".", ".")


def without_adapters(named: Mapping[str, object]) -> dict:
    """``named`` (tensor name -> anything) as the unadapted model names it: adapters left out,
    base weights under their plain names (a checkpoint of a run without LoRA)."""
    return {base_name(k): v for k, v in named.items() if not _LORA.search(k)}


# ------------------------------------------------------------------------------ weights


class _BaseView:
    """The model as the sources of the unadapted model see it: a module path that names a
    LoRA layer gives its base layer (``SeededInit`` asks the owning module of a tensor for its
    initialisation rule, and asks the enclosing modules too)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def get_submodule(self, path: str) -> nn.Module:
        module = self.model.get_submodule(path)
        base = getattr(module, "get_base_layer", None)
        return base() if base is not None else module


class LoraWeights(WeightSource):
    """The build's weight source for an adapted model: base weights from ``inner`` under their
    original names, A from peft's initialisation (``kaiming_uniform_(a=sqrt(5))``, as
    ``nn.Linear``) seeded by (seed, name), B zero."""

    def __init__(self, inner: WeightSource, seed: int):
        self.inner, self.seed = inner, int(seed)

    def has(self, name: str) -> bool:
        return bool(_LORA.search(name)) or self.inner.has(base_name(name))

    def read(self, name, model, shape, index):
        which = _LORA.search(name)
        if which is None:
            return self.inner.read(base_name(name), _BaseView(model), shape, index)
        if which.group(1) == "B":
            return torch.zeros(tuple(s.stop - s.start for s in index))
        full = torch.empty(tuple(int(s) for s in shape))
        gen = torch.Generator().manual_seed(derive_seed(self.seed, name))
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        return full[index]


# ------------------------------------------------------------------------------ merge / export


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + B A alpha / r) and put the plain layer
    back under its own name: the model is then the unadapted architecture (host tensors)."""
    return _unwrap(model, fold=True)


@torch.no_grad()
def unload(model: nn.Module) -> nn.Module:
    """Put every adapted layer's base layer back, without its adapter."""
    return _unwrap(model, fold=False)


def _unwrap(model: nn.Module, fold: bool) -> nn.Module:
    for name, layer in adapted_layers(model).items():
        if fold:
            layer.merge(safe_merge=True)
        parent, _, attr = name.rpartition(".")
        base = layer.get_base_layer()
        setattr(model.get_submodule(parent), attr, base)
    return model


def adapter_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """path of each adapted layer -> (A [r, in], B [out, r])."""
    return {n: (m.lora_A[ADAPTER].weight.detach(), m.lora_B[ADAPTER].weight.detach())
            for n, m in adapted_layers(model).items()}


def write_peft_adapter(adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]], cfg: LoraConfig,
                       hf_dir: str | Path, out: str | Path) -> None:
    """The LLM's ``adapters`` (``adapter_tensors``) as a peft adapter folder
    (``adapter_config.json``, ``adapter_model.safetensors``) for the Hugging Face model in
    ``hf_dir``: the names are that model's module paths in transformers (its language model
    found with ``get_decoder()``), so ``PeftModel.from_pretrained(<hf_dir's model>, out)``
    loads it. Adapters of encoders have no such mapping here: refused (merge them instead)."""
    peft = _peft()
    import transformers
    from safetensors.torch import save_file

    others = sorted({".".join(n.split(".")[:2]) for n in adapters if not n.startswith("llm.")})
    if others:
        raise ConfigError(f"--adapter writes the LLM's adapters; this run also adapts {', '.join(others)}: "
                          "export it merged (without --adapter)")
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        hf = getattr(transformers, config.architectures[0])._from_config(config)
    decoder = hf.get_decoder()
    prefix = next(n for n, m in hf.named_modules() if m is decoder)
    paths = {n: ".".join(p for p in (prefix, n[len("llm."):]) if p) for n in adapters}
    known = dict(hf.named_modules())
    for ours, theirs in paths.items():
        if not isinstance(known.get(theirs), nn.Linear):
            raise ConfigError(f"{hf_dir}: {type(hf).__name__} has no linear layer {theirs} for the adapter of "
                              f"{ours}; export merged (without --adapter)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=sorted(paths.values()),
                    base_model_name_or_path=str(hf_dir)).save_pretrained(str(out))
    tensors = {}
    for name, (a, b) in adapters.items():
        key = f"base_model.model.{paths[name]}"  # how peft names a saved adapter's tensors
        tensors[f"{key}.lora_A.weight"] = a.detach().to("cpu").contiguous().clone()
        tensors[f"{key}.lora_B.weight"] = b.detach().to("cpu").contiguous().clone()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------ tensor parallelism


def tensor_parallel_plan(root: nn.Module, plan: dict) -> dict:
    """``plan`` (module path under ``root`` -> ParallelStyle) with each entry for an adapted
    layer turned into entries for its base layer and adapters (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    out = {}
    for path, style in plan.items():
        if not _is_lora(root.get_submodule(path)):
            out[path] = style
            continue
        out[f"{path}.base_layer"] = style
        a, b = f"{path}.lora_A.{ADAPTER}", f"{path}.lora_B.{ADAPTER}"
        if isinstance(style, ColwiseParallel) and style.input_layouts == (Replicate(),):
            out[b] = ColwiseParallel(output_layouts=style.output_layouts[0], use_local_output=style.use_local_output)
        elif isinstance(style, RowwiseParallel) and style.input_layouts == (Shard(-1),):
            placement = style.output_layouts[0]
            out[a] = RowwiseParallel(output_layouts=placement, use_local_output=True)
            if isinstance(placement, Shard):
                out[b] = SequenceParallel(sequence_dim=placement.dim, use_local_output=style.use_local_output)
            # a replicated output: B stays a plain tensor, the same input and gradient on every rank
        else:
            raise NotImplementedError(f"LoRA under tensor parallelism: no rule for {path}'s {style}")
    return out
