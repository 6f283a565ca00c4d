"""What a training run and a simulated one both are: a model (its backbone and encoder slots) on
a layout (the parallel sizes and the multiplexing). ``omni train``'s config
(``recipes.schema.OmniConfig``) and ``omni simulate`` / ``omni plan``'s (``omni.sim.config.SimConfig``)
extend it with what each adds (data, optimizer and trainer; the simulated data, cluster and
search), so a model or layout override means the same to both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from omni.models.config import EncoderSlot, ModelConfig
from omni.step.config import MultiplexConfig
from parallel.config import ParallelConfig


@dataclass
class ModelOnLayout:
    # Name of the run; experiment presets set it, and the default run dir uses it.
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    # Encoder slots by name (e.g. "vision", "audio"); each names its plugin.
    encoders: Dict[str, EncoderSlot] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    multiplex: MultiplexConfig = field(default_factory=MultiplexConfig)
