"""Compose the Hydra config from the packaged ``conf/`` (works for editable and plain installs)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from recipes.schema import register_configs

CONFIG_MODULE = "conf"
GROUPS = ("model", "encoders", "data", "parallel", "multiplex", "optim", "trainer", "checkpoint", "experiment")


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Hydra compose with Omni's schema; raises Hydra/OmegaConf errors for bad overrides and
    ``ConfigError`` for a bad value of the training config (recipes/checks.py), and names the
    run after what it trains (recipes/run_info.py)."""
    from recipes.checks import check_config
    from recipes.run_info import name_the_run

    training = config_name == "config"
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=training)
    if training:
        model_choice = cfg.hydra.runtime.choices.get("model")
        with open_dict(cfg):
            del cfg["hydra"]
        if model_choice == "hf" and not cfg.model.pretrained:
            # conf/model/hf.yaml's `pretrained: ???` cannot make the key required: merged onto the
            # schema's default (None) it leaves None, and the tiny default model would train.
            from omni.errors import ConfigError

            raise ConfigError("model=hf takes its architecture and weights from a Hugging Face checkpoint: add "
                              "model.pretrained=/path/to/checkpoint (a local folder with config.json)")
        name_the_run(cfg, list(overrides), model_choice)
    # Resolve interpolations now so a bad one fails before any work starts.
    OmegaConf.resolve(cfg)
    if training:
        check_config(OmegaConf.to_object(cfg))
    return cfg


def group_options() -> dict[str, list[str]]:
    """Option names per config group, read from the installed package; nested groups (the
    encoder slots' presets, ``encoders/vision``) follow their parent."""
    root = resources.files(CONFIG_MODULE)
    out: dict[str, list[str]] = {}

    def walk(group: str, folder) -> None:
        options = sorted(Path(p.name).stem for p in folder.iterdir() if p.name.endswith(".yaml"))
        if options:
            out[group] = options
        for sub in sorted(folder.iterdir(), key=lambda p: p.name):
            if sub.is_dir() and not sub.name.startswith("__"):
                walk(f"{group}/{sub.name}", sub)

    for group in GROUPS:
        folder = root / group
        if folder.is_dir():
            walk(group, folder)
    return out
