"""What ``omni export`` and ``omni generate`` take as ``--model``: a Hugging Face directory of a
supported family, a run directory (its newest completed checkpoint, or ``--step N``), or one
checkpoint folder of a run. Each becomes the whole model on the host in one process, with the
tokenizer it was trained with (a run keeps its own under ``<run_dir>/tokenizer``)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from omni.errors import ConfigError



@dataclass
class LoadedModel:
    model: object  # OmniModel
    tokenizer: object  # dataloading.formats.tokenizer.Tokenizer
    weights: Path  # the folder the weights came from
    cfg: Optional[object] = None  # the run's OmniConfig (None for a Hugging Face directory)


def _run_of_checkpoint(path: Path) -> Path:
    run = path.parent.parent  # <run_dir>/checkpoints/step_N
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"checkpoint {path}: its run directory (with config.yaml) is not {run}; pass the run "
                          "directory instead (checkpoint.dir elsewhere: pass the run directory and --step)")
    return run


def _checkpoint_of_run(run: Path, cfg, step: Optional[int]) -> Path:
    from omni.runtime.checkpoint_files import PREFIX, completed_checkpoints

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run / "checkpoints"
    done = completed_checkpoints(root)
    if step is not None:
        done = [p for p in done if int(p.name[len(PREFIX):]) == step]
        if not done:
            raise ConfigError(f"run {run} has no completed checkpoint of step {step} under {root}")
    if not done:
        raise ConfigError(f"run {run} has no completed checkpoint under {root}; train with "
                          "checkpoint.every=N (or to the end: one is saved at the last step)")
    return done[-1]


def init_checkpoint(spec: str, key: str = "model.init_from") -> Path:
    """The checkpoint folder ``spec`` names: itself, or a run directory's newest completed
    checkpoint; one line when it is neither."""
    from omni.runtime.checkpoint_files import MARKER

    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}={spec}: no such run directory or checkpoint folder; train that run first, or "
                          "pass runs/NAME or runs/NAME/checkpoints/step_N")
    if (path / MARKER).exists():
        return path
    if (path / "config.yaml").is_file():
        return _checkpoint_of_run(path, run_config(path), None)
    hf = " (a Hugging Face directory: use model.pretrained)" if (path / "config.json").is_file() else ""
    raise ConfigError(f"{key}={spec} is neither a run directory (config.yaml) nor a checkpoint folder "
                      f"({MARKER}){hf}; pass runs/NAME or runs/NAME/checkpoints/step_N")


def run_config(run: Path):
    """The run's composed config (``config.yaml``: the backbone's architecture as built)."""
    from omegaconf import OmegaConf

    from recipes.schema import OmniConfig

    merged = OmegaConf.merge(OmegaConf.structured(OmniConfig), OmegaConf.load(run / "config.yaml"))
    return OmegaConf.to_object(merged)


@dataclass
class Located:
    """Where a ``--model`` argument's weights are: a Hugging Face directory (``hf``), or a run's
    checkpoint folder with its run directory."""

    hf: Optional[Path] = None
    run: Optional[Path] = None
    checkpoint: Optional[Path] = None


def locate(spec: str, step: Optional[int] = None) -> Located:
    """Check ``--model`` (and ``--step``) without reading any weight; one line when it is wrong."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--model {spec}: no such directory; pass a Hugging Face model directory, a run "
                          "directory (runs/NAME) or a checkpoint folder (runs/NAME/checkpoints/step_N)")
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        if step is not None:
            raise ConfigError(f"--step is for run directories; {path} is a Hugging Face directory")
        from omni.models.families import family_of

        family_of(str(path))
        return Located(hf=path)
    from omni.runtime.checkpoint_files import MARKER

    if (path / MARKER).exists():
        return Located(run=_run_of_checkpoint(path), checkpoint=path)
    if (path / "config.yaml").is_file():
        return Located(run=path, checkpoint=_checkpoint_of_run(path, run_config(path), step))
    raise ConfigError(f"--model {spec}: neither a Hugging Face directory (config.json), a run directory "
                      "(config.yaml) nor a checkpoint folder (COMPLETE)")


def load_model(spec: "str | Located", step: Optional[int] = None, attn_backend: str = "sdpa",
               merge_adapters: bool = True) -> LoadedModel:
    """``spec``: a Hugging Face directory, a run directory or a checkpoint folder (or where
    ``locate`` found one). A run trained with LoRA (``model.lora``) comes back with its adapters
    merged into the base weights, as the plain architecture (``merge_adapters=False``: as
    trained, adapters apart)."""
    where = spec if isinstance(spec, Located) else locate(spec, step)
    if where.hf is not None:
        from omni.models.families import load_pretrained, pretrained_tokenizer

        model = load_pretrained(str(where.hf), attn_backend=attn_backend)
        return LoadedModel(model.eval(), pretrained_tokenizer(str(where.hf), sorted(model.encoders)), where.hf)
    from dataloading.formats.tokenizer import load_tokenizer
    from omni.models.build import build_meta_model
    from omni.runtime.checkpoint_files import load_model_weights

    cfg = run_config(where.run)
    tokenizer = load_tokenizer(where.run / "tokenizer")
    # The saved config holds the backbone as built, so its checkpoint directory is not read
    # again (it may be gone); an encoder slot's pretrained directory still gives the tower's
    # shape (its config.json).
    model_cfg = replace(cfg.model, pretrained=None, attn_backend=attn_backend)
    for name, slot in cfg.encoders.items():
        if slot.pretrained and not Path(slot.pretrained).is_dir():
            raise ConfigError(f"encoders.{name}.pretrained={slot.pretrained} (the run's encoder checkpoint) is gone; "
                              "its config.json gives the tower's shape: restore the directory")
    model, _ = build_meta_model(model_cfg, cfg.encoders, vocab_needed=tokenizer.vocab_size, seed=cfg.trainer.seed)
    load_model_weights(model, where.checkpoint)
    if merge_adapters:
        from omni.models import lora

        lora.merge(model)
    return LoadedModel(model.eval(), tokenizer, where.checkpoint, cfg)
