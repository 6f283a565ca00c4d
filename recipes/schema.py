"""The composed training config: one dataclass per group, registered in Hydra's ConfigStore
so that an override of a key that does not exist fails and names the key."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from hydra.core.config_store import ConfigStore

from dataloading.config import DataConfig
from omni.models.config import EncoderSlot, ModelConfig
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.step.config import MultiplexConfig
from parallel.config import ParallelConfig


@dataclass
class OmniConfig:
    # Name of the run; experiment presets set it, and the default run dir uses it.
    name: str = "demo"
    model: ModelConfig = field(default_factory=ModelConfig)
    # Encoder slots by name (e.g. "vision", "audio"); each names its plugin.
    encoders: Dict[str, EncoderSlot] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    multiplex: MultiplexConfig = field(default_factory=MultiplexConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register_configs() -> None:
    """Idempotent: ConfigStore replaces entries with the same name."""
    from omni.sim.config import SimConfig

    cs = ConfigStore.instance()
    cs.store(name="omni_schema", node=OmniConfig)
    cs.store(name="omni_sim_schema", node=SimConfig)  # omni simulate / omni plan
