"""Compose the Hydra config from the packaged ``conf/`` (works for editable and plain installs)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from recipes.schema import register_configs

CONFIG_MODULE = "conf"
GROUPS = ("model", "encoders", "data", "parallel", "optim", "trainer", "checkpoint", "experiment")


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Hydra compose with Omni's schema; raises Hydra/OmegaConf errors for bad overrides."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    # Resolve interpolations now so a bad one fails before any work starts.
    OmegaConf.resolve(cfg)
    return cfg


def group_options() -> dict[str, list[str]]:
    """Option names per config group, read from the installed package."""
    root = resources.files(CONFIG_MODULE)
    out: dict[str, list[str]] = {}
    for group in GROUPS:
        folder = root / group
        if folder.is_dir():
            out[group] = sorted(Path(p.name).stem for p in folder.iterdir() if p.name.endswith(".yaml"))
    return out
