"""What a run is called and what it records about itself: the run's name (and so its default
folder ``runs/<name>``), the start-up banner, and the ``config.yaml`` and ``tokenizer/`` it leaves
in the run directory.

Naming. An experiment preset names its runs (``name: demo``) only while the run trains what the
preset describes. An override of what is trained (the model or its checkpoint, the encoders, the
mixture, the tokenizer) makes another experiment, and it gets a name of its own,
``<model>-<digest>``: ``<model>`` is the model preset (``tiny_moe``) or the folder name of
``model.pretrained``, and the digest is six hex digits of the resolved model, encoders, mixture and
tokenizer. So ``omni train model=tiny_moe`` after the demo writes ``runs/tiny_moe-<digest>`` and
never resumes the demo's checkpoints, while the same command again finds its own. ``name=...`` or
``trainer.run_dir=...`` choose explicitly.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

# Overrides of these keys (or of these config groups) change what is trained.
_WHAT_KEYS = ("model", "encoders", "data.mixture", "data.tokenizer")
# ... except these, which change how, not what.
_HOW_KEYS = ("model.attn_backend",)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".")


def changes_what_runs(override: str) -> bool:
    key = _key(override)
    if any(key == k or key.startswith(k + ".") for k in _HOW_KEYS):
        return False
    return any(key == k or key.startswith(k + ".") for k in _WHAT_KEYS) or key == "data"


def what_runs(cfg: DictConfig) -> dict:
    """The parts of a composed config that decide which model is trained on which data."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("attn_backend", None)
    return {"model": model, "encoders": OmegaConf.to_container(cfg.encoders, resolve=True),
            "mixture": cfg.data.mixture, "tokenizer": cfg.data.tokenizer}


def name_the_run(cfg: DictConfig, overrides: list[str], model_choice: str | None) -> None:
    """Set ``cfg.name`` (before interpolations resolve, so ``runs/${name}`` follows) when the
    overrides train something other than the experiment preset; see the module docstring."""
    if any(_key(o) == "name" for o in overrides) or not any(changes_what_runs(o) for o in overrides):
        return
    pretrained = cfg.model.get("pretrained") if not OmegaConf.is_missing(cfg.model, "pretrained") else None
    label = Path(str(pretrained)).expanduser().resolve().name if pretrained else (model_choice or "model")
    digest = hashlib.sha256(json.dumps(what_runs(cfg), sort_keys=True, default=str).encode()).hexdigest()[:6]
    with open_dict(cfg):
        cfg.name = f"{label}-{digest}"


def saved_config(cfg, llm_config) -> str:
    """``config.yaml`` of the run: the composed config, with the backbone's fields replaced by
    the architecture that was really built (config.json's under ``model.pretrained``, and the
    vocabulary after the tokenizer's placeholders were added)."""
    from dataclasses import fields, replace

    arch = {f.name: getattr(llm_config, f.name) for f in fields(llm_config)}
    model = replace(cfg.model, **{k: v for k, v in arch.items() if k in {f.name for f in fields(cfg.model)}})
    return OmegaConf.to_yaml(OmegaConf.structured(replace(cfg, model=model)))


def shown_config(dcfg: DictConfig) -> str:
    """``omni train --cfg job``: the composed config, and under ``model.pretrained`` the
    backbone's fields as the checkpoint's config.json gives them (what will be built, not the
    preset's values that it ignores), each marked with a comment."""
    if not dcfg.model.get("pretrained"):
        return OmegaConf.to_yaml(dcfg)
    from dataclasses import fields

    from recipes.checks import pretrained_architecture

    cfg = OmegaConf.to_object(dcfg)
    arch = pretrained_architecture(cfg.model.pretrained)
    taken = {f.name for f in fields(arch)} & {f.name for f in fields(cfg.model)}
    mark = f"  # from {Path(cfg.model.pretrained) / 'config.json'}"
    lines, in_model = [], False
    for line in saved_config(cfg, arch).splitlines():
        if line and not line.startswith(" "):
            in_model = line == "model:"
        key = line.strip().split(":", 1)[0]
        # only the section's own keys (two spaces in), not the nested ones (model.lora.*)
        own = line.startswith("  ") and not line.startswith("   ") and not line.startswith("  -")
        lines.append(line + mark if in_model and own and key in taken else line)
    return "\n".join(lines) + "\n"


def describe_training(model, names, lora=None) -> str:
    """What trains, for the banner: "0.05M trainable; frozen: llm, encoder.vision" (a module
    counts as frozen when none of its parameters trains). With ``lora`` (``model.lora``, rank > 0)
    the adapters lead: "LoRA rank 8, alpha 16 on llm (14 layers: q_proj, v_proj), 24,576 adapter
    weights; ...", the layer names as peft matched them (``all-linear`` resolved)."""
    counts: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        unit = counts.setdefault(names.unit_of(name) or "other", [0, 0])
        unit[0] += p.numel() * p.requires_grad
        unit[1] += p.numel()
    trainable = sum(t for t, _ in counts.values())
    frozen = [u for u in names.units if u in counts and counts[u][0] == 0]
    text = f"{trainable / 1e6:.2f}M trainable" + (f"; frozen: {', '.join(frozen)}" if frozen else "")
    if lora is None or not lora.rank:
        return text
    from omni.models.lora import adapter_tensors

    adapters = adapter_tensors(model)
    weights = sum(a.numel() + b.numel() for a, b in adapters.values())
    leaves = ", ".join(sorted({path.rsplit(".", 1)[-1] for path in adapters}))
    return (f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.modules)} ({len(adapters)} layers: "
            f"{leaves}), {weights:,} adapter weights; {text}")


def describe_model(cfg, llm_config, n_params: int, training: str = "") -> str:
    c = llm_config
    source = f"from {cfg.model.pretrained}" if cfg.model.pretrained else "random init"
    moe = f", {c.num_experts} experts top-{c.num_experts_per_tok}" if c.num_experts else ""
    encoders = ", ".join(f"{slot}={s._target_ or s.name}{' (' + s.pretrained + ')' if s.pretrained else ''}"
                         for slot, s in cfg.encoders.items()) or "none"
    return (f"{c.family} {c.num_layers} layers x {c.hidden_size}{moe}, vocab {c.vocab_size} ({source}); "
            f"encoders {encoders}; {n_params / 1e6:.2f}M parameters" + (f" ({training})" if training else ""))


def record_run(cfg, run_dir: Path, tokenizer, llm_config, n_params: int, layout_text: str, mixture: str,
               training: str = "", threads: str = "") -> None:
    """On the main rank: write ``config.yaml`` and ``tokenizer/`` into the run dir and print
    the banner (what really runs, how many CPU threads each rank computes with
    (``recipes.threads``), where it writes)."""
    from dataloading.formats.tokenizer import save_tokenizer

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(saved_config(cfg, llm_config))
    save_tokenizer(tokenizer, run_dir / "tokenizer")
    print(f"omni: {cfg.name}: {describe_model(cfg, llm_config, n_params, training)}, layout {layout_text}"
          f"{', ' + threads if threads else ''}, data {mixture}, run dir {run_dir}", flush=True)


def configured_modalities(cfg) -> list[str]:
    """The modalities of the configured encoder slots (``image`` for a ``vision`` slot): only
    their placeholders go into the tokenizer's vocabulary."""
    from omni.models.encoders.registry import get_encoder_class

    return sorted(get_encoder_class(s._target_ or s.name).modality for s in cfg.encoders.values())


def run_tokenizer(cfg):
    """data.tokenizer, with the placeholders of the configured modalities, written as the
    family of ``model.pretrained`` writes them (Qwen2-VL: ``<|vision_start|><|image_pad|>...``)."""
    from dataloading.formats.tokenizer import load_tokenizer

    family_tokens = None
    if cfg.model.pretrained and str(cfg.data.tokenizer) != "byte":
        from omni.models.families import family_of

        family_tokens = dict(family_of(cfg.model.pretrained)[1].family_tokens) or None
    from dataloading.formats.chat import resolve_chat_template

    return load_tokenizer(cfg.data.tokenizer, modalities=configured_modalities(cfg), family_tokens=family_tokens,
                          chat_template=resolve_chat_template(cfg.data.chat_template))
