"""AdamW's parameter groups each hold one kind of tensor. torch runs foreach kernels by default
on CUDA, and a foreach op refuses a list that mixes DTensors and plain tensors: a part with
tensor-parallel DTensor weights beside plain norm gains (tp > 1, no FSDP) would crash on its
first GPU step. Here every group is forced to foreach, as CUDA's default would, on 2 gloo ranks;
the step runs and equals single-tensor AdamW on the whole tensors."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
from dist_helpers import run_ranks  # noqa: E402


def _step_mixed_kinds(rank, world, out_dir):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from omni.runtime.config import OptimConfig
    from omni.runtime.optim import build_optimizer

    torch.manual_seed(0)
    full = {"proj": torch.randn(4, 6), "bias": torch.randn(6), "norm": torch.randn(6), "head": torch.randn(6, 3)}
    grads = {k: torch.randn_like(v) for k, v in full.items()}
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Module()
    model.proj = nn.Parameter(distribute_tensor(full["proj"].clone(), mesh, [Shard(0)]))  # column-parallel
    model.bias = nn.Parameter(distribute_tensor(full["bias"].clone(), mesh, [Shard(0)]))
    model.norm = nn.Parameter(full["norm"].clone())  # a plain, replicated norm gain
    model.head = nn.Parameter(full["head"].clone())
    cfg = OptimConfig()
    opt = build_optimizer(model, cfg)
    kinds = [{isinstance(p, DTensor) for p in g["params"]} for g in opt.param_groups]
    assert all(len(k) == 1 for k in kinds), f"a group mixes DTensors and plain tensors: {kinds}"
    for g in opt.param_groups:
        g["foreach"] = True  # what torch picks on CUDA for these parameters
    for name, p in model.named_parameters():
        p.grad = distribute_tensor(grads[name], mesh, p.placements) if isinstance(p, DTensor) else grads[name].clone()
    opt.step()

    ref = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    for k, p in ref.items():
        p.grad = grads[k].clone()
    ref_opt = build_optimizer(nn.ParameterDict(ref), cfg)  # plain tensors only: single-tensor AdamW
    for g in ref_opt.param_groups:
        g["foreach"] = False
    ref_opt.step()
    for name, p in model.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        err = float((got - ref[name].detach()).abs().max())
        assert err <= 1e-6, f"{name}: max error {err} against single-tensor AdamW"


def test_dtensor_and_plain_parameters_step_under_foreach(tmp_path):
    run_ranks(_step_mixed_kinds, 2, str(tmp_path), timeout_s=120)


def test_plain_model_keeps_decay_then_no_decay_groups():
    """A model of plain tensors gets the two groups it always had (decayed matrices first), so
    single-process numerics and optimizer state stay as they were."""
    from torch import nn

    from omni.runtime.config import OptimConfig
    from omni.runtime.optim import build_optimizer

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert [(len(g["params"]), g["weight_decay"], g["foreach"]) for g in opt.param_groups] == [
        (1, 0.1, None), (3, 0.0, None)]
