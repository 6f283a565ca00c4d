"""AdamW's parameter groups each hold one kind of tensor. torch runs foreach kernels by default
on CUDA, and a foreach op refuses a list that mixes DTensors and plain tensors: a part with
tensor-parallel DTensor weights beside plain norm gains (tp > 1, no FSDP) would crash on its
first GPU step. Here every group is forced to foreach, as CUDA's default would, on 2 gloo ranks;
the step runs and equals single-tensor AdamW on the whole tensors. Then ``optim.groups``: each
group's first step against a hand-computed AdamW step, in one process and under dp_shard=2."""
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


def _both(rank, world, out_dir):
    _step_mixed_kinds(rank, world, out_dir)
    _groups_under_dp_shard(rank, world)


def test_dtensor_and_plain_parameters_step_under_foreach(tmp_path):
    """One spawn for both: also ``optim.groups`` under dp_shard=2 (``_groups_under_dp_shard``)."""
    run_ranks(_both, 2, str(tmp_path), timeout_s=120)


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


# -- optim.groups: each group's update uses its own lr and weight decay --------------------
GROUPS = {"projectors": {"lr": 1e-2}, "llm": {"lr": 1e-3, "weight_decay": 0.0}, "encoder.image": {"weight_decay": 0.5}}
# At the first step (warmup 2: factor 1/2): each parameter's lr and decay.
EXPECTED = {"llm.weight": (5e-4, 0.0), "llm.bias": (5e-4, 0.0),
            "encoders.image.weight": (5e-5, 0.5), "encoders.image.bias": (5e-5, 0.0),  # optim.lr; its own decay
            "projectors.image.weight": (5e-3, 0.1), "projectors.image.bias": (5e-3, 0.0)}  # optim's decay
LOGGED = {"lr/projectors": 5e-3, "lr/llm": 5e-4, "lr/encoder.image": 5e-5}


def _tiny_model():
    """Parameters named as the model's: llm.*, encoders.<modality>.*, projectors.<modality>.*."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    m = nn.Module()
    m.llm = nn.Linear(4, 3, dtype=torch.float64)
    m.encoders = nn.ModuleDict({"image": nn.Linear(3, 3, dtype=torch.float64)})
    m.projectors = nn.ModuleDict({"image": nn.Linear(3, 4, dtype=torch.float64)})
    grads = {name: torch.randn_like(p) for name, p in m.named_parameters()}
    return m, grads


def _hand_step(p, g, lr, wd, eps=1e-8):
    """AdamW's first step: decay, then m_hat = g, v_hat = g^2."""
    return p * (1 - lr * wd) - lr * g / (g.abs() + eps)


def _check_group_step(full_params, expected_from, grads) -> list[str]:
    bad = []
    for name, (lr, wd) in EXPECTED.items():
        want = _hand_step(expected_from[name], grads[name], lr, wd)
        err = float((full_params[name] - want).abs().max())
        if not err <= 1e-12:
            bad.append(f"{name}: max error {err} against the hand-computed AdamW step (lr {lr}, decay {wd})")
    return bad


def _optim_cfg():
    from omni.runtime.config import OptimConfig

    return OptimConfig(lr=1e-4, weight_decay=0.1, warmup_steps=2, groups=GROUPS)


def test_each_group_steps_with_its_own_lr_and_decay():
    from omni.runtime.optim import PartOptimizers

    model, grads = _tiny_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = PartOptimizers([model], _optim_cfg(), total_steps=10)
    assert opt.lr == 5e-4 and opt.group_lrs() == LOGGED  # lr is the llm's
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    opt.step()
    bad = _check_group_step({n: p.detach() for n, p in model.named_parameters()}, start, grads)
    assert not bad, "\n".join(bad)
    assert opt.group_lrs() == {k: 2 * v for k, v in LOGGED.items()}  # warmup done: the peaks


def test_resumed_schedules_keep_each_parts_own_peaks():
    """A checkpoint holds rank 0's first part's schedule; a part with other groups (the media
    tower beside an LLM chunk) keeps its own peaks when it loads it."""
    from omni.runtime.optim import PartOptimizers

    llm, tower = _tiny_model()[0], _tiny_model()[0]  # parameter names as in the whole model
    del llm.encoders, llm.projectors, tower.llm, tower.encoders
    opt = PartOptimizers([llm, tower], _optim_cfg(), total_steps=10)
    opt.step()
    state = opt.scheduler_state()
    again = PartOptimizers([llm, tower], _optim_cfg(), total_steps=10)
    again.load_scheduler_state(state)
    again.step()
    assert [g["lr"] for g in again.optimizers[1].param_groups] == [1e-2, 1e-2]  # the projector's peak
    assert [g["lr"] for g in again.optimizers[0].param_groups] == [1e-3, 1e-3]


def _groups_under_dp_shard(rank, world):
    """The same step with every parameter sharded by FSDP2 (DTensors) over 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from omni.runtime.optim import PartOptimizers

    model, grads = _tiny_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = PartOptimizers([model], _optim_cfg(), total_steps=10)
    assert opt.group_lrs() == LOGGED
    for name, p in model.named_parameters():
        p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
    opt.step()
    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    bad = _check_group_step(full, start, grads)
    assert not bad, "\n".join(bad)
