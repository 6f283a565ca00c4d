"""The composed training config: one dataclass per group, registered in Hydra's ConfigStore
so that an override of a key that does not exist fails and names the key."""
from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from dataloading.config import DataConfig
from omni.run_config import ModelOnLayout
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig


@dataclass
class OmniConfig(ModelOnLayout):
    name: str = "demo"
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

def register_configs() -> None:
    """Idempotent: ConfigStore replaces entries with the same name."""
    from omni.sim.config import SimConfig

    cs = ConfigStore.instance()
    cs.store(name="omni_schema", node=OmniConfig)
    cs.store(name="omni_sim_schema", node=SimConfig)  # omni simulate / omni plan
