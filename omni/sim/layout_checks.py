"""The layout checks a placement's layout passes before it is simulated: the training layout's
own (a layout that passes is one ``omni train`` accepts), the multiplex config's rules on it, and
the encoder pool the disaggregated baseline's checks assume."""
from __future__ import annotations

import dataclasses

from omni.errors import ConfigError
from omni.sim import disaggregated
from omni.sim.config import SimConfig
from omni.sim.spec import ModelSpec
from omni.step.multiplex_rules import PLACEMENTS, check_multiplex_layout
from parallel.config import ParallelConfig
from parallel.pipeline_schedule import EXECUTOR_SCHEDULES
from parallel.sizing import LayoutError, Sizes, check_model_fits, check_sequence, resolve_sizes


def llm_sizes(parallel: ParallelConfig, world: int, spec: ModelSpec, tokens: int, gpus_per_node: int) -> Sizes:
    """The training layout's own checks: a layout that passes is one ``omni train`` accepts."""
    sizes = resolve_sizes(parallel, world)
    c = spec.llm
    check_model_fits(sizes, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, num_layers=c.num_layers,
                     num_experts=c.num_experts, virtual_stages=parallel.pp_virtual_stages if sizes.pp > 1 else 1,
                     cp_impl=parallel.cp_impl, activation_offload=parallel.activation_offload,
                     fp8=parallel.fp8, hidden_size=c.hidden_size)
    check_sequence(sizes, tokens)
    if sizes.tp > gpus_per_node:
        raise LayoutError(f"parallel.tp={sizes.tp} spans nodes of cluster.gpus_per_node={gpus_per_node}; "
                          f"keep TP inside a node")
    if parallel.fp8:
        raise ConfigError("parallel.fp8=true: the simulator does not model FP8 matmuls and their casts; simulate the "
                          "run with parallel.fp8=false (its bf16 time is an upper bound)")
    if sizes.pp > 1 and parallel.pp_schedule not in EXECUTOR_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule}: the simulator replays "
                          f"{', '.join(EXECUTOR_SCHEDULES)} (Omni's executor); zero_bubble is not modelled")
    return sizes


def check_encoder_sp(cfg: SimConfig, sizes: Sizes, placement: str, pool: int = 0) -> None:
    """The multiplex config's rules on the layout a placement runs (the runtime's own,
    ``check_multiplex_layout``): multiplex.encoder_sp splits the encoder GPUs (``pool`` of them
    for the disaggregated baseline) into whole SP blocks inside a node, and so on."""
    mux = dataclasses.replace(cfg.multiplex, placement=placement if placement in PLACEMENTS else "colocated")
    try:
        check_multiplex_layout(mux, sizes, cfg.cluster.gpus_per_node, cfg.parallel.pp_schedule, encoder_gpus=pool)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def disaggregated_split(cfg: SimConfig) -> int:
    """GPUs the disaggregated baseline gives the encoders: ``sim.encoder_gpus``, or with 0 the
    smallest candidate of ``pool_candidates`` (for the up-front checks; the run's pool is
    chosen by ``simulate_placement``)."""
    return disaggregated.pool_candidates(cfg)[0]
