"""The simulator under parallel.activation_offload: the offloaded blocks' activations leave the
GPU's memory (two blocks' worth come back during the backward), and their copies over the host
link cost what the blocks' compute does not cover."""
from __future__ import annotations

import pytest

from omni.sim.compare import simulate
from omni.sim.spec import model_spec
from omni.sim import memory
from recipes.simulate_cmd import load_sim_config

BASE = ["workload=none", "cluster=h100", "cluster.num_gpus=8", "parallel.pp=2", "parallel.tp=2",
        "data.global_batch_size=32", "data.micro_batch_tokens=1024", "data.sample_tokens=256",
        "data.image_tokens_min=16", "data.image_tokens_max=64", "data.steps=1", "sim.placements=[colocated]"]


def _run(*extra: str) -> dict:
    return simulate(load_sim_config([*BASE, *extra]))["placements"]["colocated"]


def test_offloaded_activations_leave_the_gpu_and_the_copies_show_on_a_slow_link():
    plain, offloaded = _run(), _run("parallel.activation_offload=all")
    assert offloaded["memory_gib"]["activations"] < plain["memory_gib"]["activations"]
    assert offloaded["memory_gib"]["transient"] > plain["memory_gib"]["transient"]  # two blocks come back
    # a fast link hides every copy behind the blocks' compute; a slow one does not
    fast = _run("parallel.activation_offload=all", "cluster.host_gbps=1e6")
    slow = _run("parallel.activation_offload=all", "cluster.host_gbps=0.5")
    assert fast["step_time_s"] == pytest.approx(plain["step_time_s"])
    assert slow["step_time_s"] > plain["step_time_s"]
    # one block offloaded: between none and all
    some = _run("parallel.activation_offload=[0]")
    assert offloaded["memory_gib"]["activations"] < some["memory_gib"]["activations"] \
        < plain["memory_gib"]["activations"]


def test_offloaded_block_bytes_are_what_the_block_keeps():
    cfg = load_sim_config(BASE)
    spec = model_spec(cfg.model, cfg.encoders)
    layers = range(spec.num_layers)
    whole = memory.llm_activation_bytes(spec, layers, 512.0)
    moved = memory.offloaded_block_bytes(spec, layers, 512.0, {0, 1})
    kept = memory.llm_activation_bytes(spec, layers, 512.0, offload={0, 1})
    assert set(moved) == {0, 1}
    assert whole == pytest.approx(kept + sum(moved.values()))


def test_a_bad_block_is_refused_before_simulating():
    with pytest.raises(ValueError, match=r"parallel.activation_offload=.*block 99 is not in"):
        _run("parallel.activation_offload=[99]")


def test_fp8_is_refused_rather_than_priced_as_bf16():
    from omni.errors import ConfigError

    with pytest.raises(ConfigError, match="does not model FP8"):
        _run("parallel.fp8=true", "parallel.tp=1")
