"""One home for the multiplex config's rules on a layout (issue 39): ``check_multiplex_layout`` is what
the runtime's Multiplexer runs at start-up, what ``omni train`` checks before anything starts and what
the simulator checks for each layout it costs, so the three give the same line. Before, encoder_sp
had to fit a node at run time but not in the simulator, and stage0's SP block had to fit a DP
group's first-stage GPUs in the simulator only. The ``multiplex`` group has presets
(``conf/multiplex/``)."""
from __future__ import annotations

import dataclasses

import pytest

from omni.errors import ConfigError
from omni.sim.layout_checks import check_encoder_sp
from omni.step.config import MultiplexConfig
from omni.step.multiplex_rules import check_multiplex_layout
from parallel.sizing import LayoutError, resolve_sizes
from parallel.config import ParallelConfig
from recipes.simulate_cmd import load_sim_config

CASES = {
    # (parallel sizes over 16 GPUs, multiplex fields, the line's words)
    "encoder_sp over a node": (dict(dp_shard=16), dict(encoder_sp=16), "must fit in a node"),
    "encoder_sp not dividing": (dict(dp_shard=16), dict(encoder_sp=3), "must divide the 16 encoder ranks"),
    "stage0 SP block over a group": (dict(dp_shard=8, pp=2), dict(placement="stage0", encoder_sp=2),
                                     "cannot span more"),
    "torch's schedule": (dict(dp_shard=8, pp=2, pp_schedule="zero_bubble", pp_virtual_stages=2), {},
                         "set parallel.pp_schedule=1f1b"),
    "lookahead": (dict(dp_shard=16), dict(lookahead=-1), "multiplex.lookahead=-1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_runtime_and_the_simulator_give_the_same_line(case):
    par, mux, words = CASES[case]
    parallel = ParallelConfig(gpus_per_node=8, **par)
    sizes = resolve_sizes(parallel, 16)
    cfg = MultiplexConfig(**mux)
    with pytest.raises(LayoutError) as runtime:
        check_multiplex_layout(cfg, sizes, 8, parallel.pp_schedule)
    assert words in str(runtime.value) and "\n" not in str(runtime.value)
    sim = dataclasses.replace(load_sim_config(["cluster.num_gpus=16"]), multiplex=cfg, parallel=parallel)
    with pytest.raises(ConfigError) as simulated:
        check_encoder_sp(sim, sizes, cfg.placement)
    assert str(simulated.value) == str(runtime.value)


def test_a_layout_that_fits_passes_both():
    parallel = ParallelConfig(gpus_per_node=8, dp_shard=8, pp=2)
    sizes = resolve_sizes(parallel, 16)
    cfg = MultiplexConfig(encoder_sp=8)
    check_multiplex_layout(cfg, sizes, 8, parallel.pp_schedule)
    check_encoder_sp(dataclasses.replace(load_sim_config(["cluster.num_gpus=16"]), multiplex=cfg, parallel=parallel),
                     sizes, "colocated")


@pytest.mark.parametrize("preset", ["colocated", "stage0", "encoder_first"])
def test_the_multiplex_group_has_a_preset_per_placement(preset):
    from omegaconf import OmegaConf

    from recipes.compose import compose_config, group_options

    assert preset in group_options()["multiplex"]
    cfg = compose_config([f"multiplex={preset}"])
    assert OmegaConf.to_object(cfg).multiplex.placement == preset
    assert OmegaConf.to_object(compose_config([])).multiplex.placement == "colocated"
