"""Freezing per module (``model.freeze``), stage schedules (``trainer.stages``) and
``model.init_from`` through ``Trainer.fit``, on the layout harness's tiny model with an image
encoder (two LLM layers, so pp=2 puts one on each stage).

The schedule is projector only for 3 steps, then everything. Under one process, dp_shard=2,
pp=2 and tp=2 (one spawn runs the three layouts): every other parameter is bit-identical after the
projector-only stage; the update equals a run where the others were frozen from the start
(same clipped update: the idle gradients are out of the norm); a run stopped in the middle of
the stage and resumed continues it exactly (losses and final weights equal the uninterrupted
run's); and the losses equal the single process's. ``init_from`` loads a single-process
checkpoint under dp_shard=2."""
from __future__ import annotations

import json
import os
import pickle
import sys
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
from dist_helpers import run_ranks  # noqa: E402
from layout_harness import OPTIM  # noqa: E402

STAGES = [{"steps": 3, "train": ["projectors"]}, {"train": ["all"]}]
STEPS = 5
PROJECTOR_ONLY = ("llm", "encoders")  # model.freeze of the run that trains the projector alone throughout
# FSDP2, PP and TP (TP re-registers the norm gains: frozen ones must stay frozen).
LAYOUTS = (("dp_shard=2", {"dp_shard": 2}), ("pp=2", {"pp": 2}), ("tp=2", {"dp_shard": 1, "tp": 2}))


class ListLoader:
    """The loader contract ``Trainer.fit`` needs (iterate, state_dict, load_state_dict)."""

    def __init__(self, batches):
        self.batches, self.next = batches, 0

    def __iter__(self):
        while self.next < len(self.batches):
            self.next += 1
            yield self.batches[self.next - 1]

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def _full(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters as whole tensors (a collective for DTensors: every rank of a
    layout holds the same names in the same order)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in pm.named_parameters()}


def fit(sizes: dict, run_dir: str, stages=(), freeze=(), stop_at=None, every=0, resume="auto", snapshot_at=None):
    """``Trainer.fit`` of the tiny model under ``sizes``: (losses, the weights its first step
    starts from (after a resume), the weights after step ``snapshot_at``, the weights at the
    end), each as this rank holds them."""
    from layout_harness import OPTIM, build, global_batches

    from dataloading.construct.batch import StepBatch
    from omni.models.freeze import ModuleNames, freeze as freeze_units
    from omni.runtime.config import CheckpointConfig, StageConfig, TrainerConfig
    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(**sizes), device="cpu")
    model = build(False, 2, ("image",))
    names = ModuleNames.of_parameters(n for n, _ in model.named_parameters())
    freeze_units(model, names, names.resolve("model.freeze", freeze))
    pm = parallelize(model, layout, MultiplexConfig())
    batches = [StepBatch(step=i + 1, micro_batches=mbs[layout.dp_rank::layout.dp_size])
               for i, mbs in enumerate(global_batches(96, ("image",), steps=STEPS))]
    cfg = TrainerConfig(max_steps=STEPS, stop_at=stop_at, run_dir=run_dir, progress=False, eval_at_end=False,
                        hang_timeout_s=0, stages=[StageConfig(**s) for s in stages])
    optim = replace(OPTIM, groups={"projectors": {"lr": 1e-2}})  # groups under every layout too
    trainer = Trainer(pm, ListLoader(batches), layout, cfg, optim,
                      CheckpointConfig(every=every, resume=resume, keep_last=0, verify="none"))
    snaps = {}
    train_step = trainer.train_step

    def step_and_snapshot(batch, step=None, **kwargs):
        snaps.setdefault("start", _full(pm))
        out = train_step(batch, step, **kwargs)
        if trainer._step == snapshot_at:
            snaps[snapshot_at] = _full(pm)
        return out

    trainer.train_step = step_and_snapshot
    losses = trainer.fit().losses
    return losses, snaps["start"], snaps.get(snapshot_at), _full(pm)


def moved(a: dict, b: dict) -> set[str]:
    return {n for n in a if not torch.equal(a[n], b[n])}


def _layouts(rank, world, out_dir, init_ckpt):
    out = {}
    for name, sizes in LAYOUTS:
        d = f"{out_dir}/{name}"
        losses, before, at3, after = fit(sizes, f"{d}/straight", STAGES, every=2, snapshot_at=3)
        # From the checkpoint in the middle of the projector-only stage, in a run dir of its own.
        rest, _, _, resumed = fit(sizes, f"{d}/resumed", STAGES, resume=f"{d}/straight/checkpoints/step_00000002")
        frozen_losses, _, _, frozen_at3 = fit(sizes, f"{d}/frozen", freeze=PROJECTOR_ONLY, stop_at=3)
        out[name] = {"losses": losses, "before": before, "at3": at3, "after": after, "split": losses[:2] + rest,
                     "resumed": resumed, "frozen_losses": frozen_losses, "frozen_at3": frozen_at3}
    # model.init_from: the single process's checkpoint into dp_shard=2 (another layout).
    from omni.runtime.parallelize import parallelize
    from omni.runtime.checkpoint import Checkpointer
    from omni.runtime.config import CheckpointConfig
    from omni.step.config import MultiplexConfig
    from layout_harness import build
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    layout = init_layout(ParallelConfig(dp_shard=2), device="cpu")
    pm = parallelize(build(False, 2, ("image",)), layout, MultiplexConfig())
    Checkpointer(CheckpointConfig(), f"{out_dir}/init", rank=rank).load_weights(init_ckpt, pm.parts)
    out["init_from"] = _full(pm)
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


def _single(tmp_path, name, **kw):
    from parallel.layout import shutdown

    try:
        return fit({}, str(tmp_path / name), **kw)
    finally:
        shutdown()


def test_stages_freeze_resume_and_init_from_equal_the_single_process(tmp_path):
    losses, before, at3, after = _single(tmp_path, "single", stages=STAGES, snapshot_at=3)
    # Projector only for 3 steps: everything else bit-identical, the projector moved.
    assert moved(before, at3) == {n for n in before if n.startswith("projectors.")}
    assert moved(at3, after) == set(before)  # then everything trains
    records = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == [1, 1, 1, 2, 2]
    assert [r["lr/projectors"] / r["lr"] for r in records] == pytest.approx([1e-2 / OPTIM.lr] * STEPS)
    # The same update as a run where the rest was frozen from the start.
    frozen_losses, _, _, frozen_at3 = _single(tmp_path, "frozen", freeze=PROJECTOR_ONLY, stop_at=3, snapshot_at=3)
    assert frozen_losses == losses[:3]
    for n, t in at3.items():
        torch.testing.assert_close(frozen_at3[n], t, rtol=0, atol=1e-7, msg=n)

    ckpt = tmp_path / "single" / "checkpoints" / f"step_{STEPS:08d}"
    run_ranks(_layouts, 2, str(tmp_path), str(ckpt), timeout_s=300)
    problems = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            res = pickle.load(f)
        for name, _ in LAYOUTS:
            r, where = res[name], f"[{name}] rank {rank}"
            held = set(r["before"])
            idle = {n for n in held if not n.startswith("projectors.")}
            if moved(r["before"], r["at3"]) & idle:
                problems.append(f"{where}: moved during the projector-only stage: {sorted(moved(r['before'], r['at3']) & idle)[:3]}")
            if not moved(r["before"], r["at3"]) >= held - idle:
                problems.append(f"{where}: the projector did not train")
            if len(r["split"]) != STEPS or r["split"] != r["losses"]:
                problems.append(f"{where}: resumed mid-stage {r['split']} != uninterrupted {r['losses']}")
            if moved(r["resumed"], r["after"]):
                problems.append(f"{where}: resumed weights differ: {sorted(moved(r['resumed'], r['after']))[:3]}")
            for i, (a, b) in enumerate(zip(r["losses"], losses)):
                if not abs(a - b) <= 1e-5 * abs(b):
                    problems.append(f"{where}: loss {i + 1} {a!r} vs single process {b!r}")
            if len(r["losses"]) != STEPS:
                problems.append(f"{where}: {len(r['losses'])} losses")
            for i, (a, b) in enumerate(zip(r["frozen_losses"], r["losses"][:3])):
                if not abs(a - b) <= 1e-6 * abs(b):
                    problems.append(f"{where}: frozen from the start, loss {i + 1} {a!r} vs staged {b!r}")
            for n in held:
                if not torch.allclose(r["frozen_at3"][n], r["at3"][n], rtol=0, atol=1e-6):
                    problems.append(f"{where}: {n} after 3 steps differs from the run frozen from the start")
        if moved(res["init_from"], after):
            problems.append(f"rank {rank}: init_from under dp_shard=2 loaded other weights: "
                            f"{sorted(moved(res['init_from'], after))[:3]}")
    assert not problems, "\n".join(problems[:30])


def test_schedule_and_names():
    from omni.models.freeze import ModuleNames
    from omni.runtime.config import StageConfig
    from omni.runtime.stages import StageSchedule

    names = ModuleNames({"vision": "image", "audio": "audio"})
    assert names.expand("encoders") == {"encoder.vision", "encoder.audio"} == names.expand("encoder")
    assert names.expand("projectors.vision") == {"projector.vision"}
    assert names.unit_of("projectors.image.fc1.weight") == "projector.vision"
    assert names.unit_of("encoders.audio.layers.0.w") == "encoder.audio"
    assert names.unit_of("llm.layers.0.self_attn.q_proj.lora_A.default.weight") == "llm"
    schedule = StageSchedule([StageConfig(2, ["projector.vision"]), StageConfig(3, ["llm", "projectors"]),
                              StageConfig(1, ["all"])], names)  # the last stage's steps do not end the run
    assert [schedule.at(s).number for s in range(1, 9)] == [1, 1, 2, 2, 2, 3, 3, 3]
    assert schedule.at(1).train == {"projector.vision"}
    assert schedule.at(99).train == set(names.units)
    line = schedule.describe(schedule.at(3), set(names.units) - {"encoder.audio"})
    assert line == ("stage 2/3 (steps 3-5): training llm, projector.vision, projector.audio; "
                    "unchanged: encoder.vision")


@pytest.mark.parametrize("overrides, message", [
    (["model.freeze=[lm]"], "model.freeze: 'lm' names no module of this model (did you mean llm?)"),
    (["model.freeze=[llm,encoders,projectors]"], "freezes every module"),
    (["encoders.vision.freeze=true", "model.freeze=[llm,encoder.audio,projectors]"], "freezes every module"),
    (["trainer.stages=[{train: [projectors]}, {train: [all]}]"], "trainer.stages[0] has no steps"),
    (["trainer.stages=[{steps: 0, train: [projectors]}, {train: [all]}]"], "trainer.stages[0].steps=0 must be"),
    (["trainer.stages=[{steps: 2, train: [al]}]"], "trainer.stages[0].train: 'al' names no module"),
    (["model.freeze=[llm]", "trainer.stages=[{steps: 2, train: [llm]}, {train: [all]}]"],
     "trainer.stages[0].train=['llm'] trains nothing: model.freeze freezes llm"),
    (["+optim.groups={projectors: {lr: 1e-3, decay: 0}}"], "optim.groups.projectors.decay: not a group setting"),
    (["+optim.groups={encoder: {lr: 1e-3}, encoders: {lr: 1e-4}}"], "name the same modules"),
    (["+optim.groups={projector.visual: {lr: 1e-3}}"], "(did you mean projector.vision?)"),
    (["+optim.groups={llm: {lr: -1}}"], "optim.groups.llm.lr=-1"),
    (["model.init_from=/no/such/run"], "model.init_from=/no/such/run: no such run directory or checkpoint folder"),
    (["model.init_from=/tmp"], "model.init_from=/tmp is neither a run directory (config.yaml) nor a checkpoint"),
])
def test_a_bad_module_setting_is_one_line(overrides, message):
    from omni.errors import ConfigError
    from recipes.compose import compose_config

    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_frozen_llm_resumes_and_init_from_refuses_another_model(tmp_path):
    """With the LLM frozen, its chunk trains nothing and saves weights only; the run resumes.
    init_from of a checkpoint of another model: one line, before any weight is read."""
    from layout_harness import build

    from omni.errors import ConfigError
    from omni.runtime.checkpoint import Checkpointer
    from omni.runtime.config import CheckpointConfig
    from parallel.layout import shutdown

    first, _, _, stopped = _single(tmp_path, "single", freeze=PROJECTOR_ONLY, stop_at=1)
    second, resumed, _, _ = _single(tmp_path, "single", freeze=PROJECTOR_ONLY, stop_at=2)
    assert len(first) == len(second) == 1 and not moved(stopped, resumed)
    other = build(False, 3, ("image",))  # a layer more
    with pytest.raises(ConfigError, match=r"model.init_from=.* holds another model .*point model.init_from at a run"):
        try:
            from parallel.config import ParallelConfig
            from parallel.layout import init_layout

            init_layout(ParallelConfig(), device="cpu")
            Checkpointer(CheckpointConfig(), tmp_path / "other").load_weights(
                tmp_path / "single" / "checkpoints" / "step_00000001", [other])
        finally:
            shutdown()
