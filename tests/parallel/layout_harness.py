"""Equality harness: a layout's first losses and first-step gradients against the single-process run.

The reference runs in the test process, the layout on spawned gloo ranks; both train the same
tiny decoder (same seed) on the same global batches (packed rows of several documents, some
positions without a target). Each data-parallel rank takes every dp-th micro-batch, and a
context-parallel rank its zig-zag slice, exactly as the data plane hands them out.
"""
from __future__ import annotations

import contextlib
import math
import tempfile
from dataclasses import asdict, replace

import torch

from dataloading.construct.batch import MicroBatch, StepBatch
from dataloading.construct.context_parallel import slice_for_cp
from layout_models import build, global_batches
from omni.runtime.config import CheckpointConfig, OptimConfig, TrainerConfig
from omni.runtime.optim import build_optimizer, build_scheduler

# bf16 runs (autocast, or bf16 FSDP parameters) against the single-process run in the same
# precision cannot be equal: a layout splits matmul reductions (TP), sums partial results in
# another order (FSDP's reduce-scatter, separate pipeline stages) and rounds each partial result
# to bf16, whose 8 mantissa bits leave a relative error of up to 2^-8 = 3.9e-3 per rounding. A
# loss or gradient passes through a few such roundings per layer on each side, so the runs
# differ by a few times 4e-3; 3e-2 is about eight roundings. An error of dtype policy or layout
# (a missing or doubled contribution) is of the size of a whole term, far above it.
BF16_TOL = 3e-2
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, warmup_steps=2, clip_grad_norm=0.5)


def autocast(precision: str):
    """``trainer.precision``: bf16 autocast on the CPU, as the Trainer enters it."""
    if precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reference(moe: bool | str, num_layers: int, media: tuple = (), data: dict | None = None, frozen: tuple = (),
              precision: str = "fp32", lora: int = 0, attn_backend: str = "auto") -> dict:
    """The single-process run: same math as the Trainer with one rank (global-token-normalised
    CE, router losses averaged over the global batch's micro-batches, clipping, AdamW), with
    the encoders run inline. ``data``: keyword arguments of ``global_batches``. ``precision``:
    "bf16" runs every forward under bf16 autocast (the GPU default, on the CPU). ``data``'s
    ``merge`` is also the vision tower's spatial merge. ``attn_backend``: ``model.attn_backend``."""
    model = build(moe, num_layers, media, frozen, (data or {}).get("merge", 1), (data or {}).get("vision", "siglip"),
                  lora=lora)
    model.set_attn_backend(attn_backend)  # the layout's kernels: the runs then differ by their layout alone
    opt = build_optimizer(model, OPTIM)
    sched = build_scheduler(opt, OPTIM, 100)
    losses, grads, norms = [], {}, []
    for step, mbs in enumerate(global_batches(model.llm.config.vocab_size, media, **(data or {}))):
        targets = sum(mb.num_target_tokens for mb in mbs)
        model.runtime.aux_weight = 1.0 / len(mbs)
        ce = 0.0
        for mb in mbs:
            with autocast(precision):
                parts = model(mb)
            (parts.ce_sum / targets).backward()
            ce += float(parts.ce_sum.detach())
        losses.append(ce / targets)
        if step == 0:  # before clipping (which would hide a uniform scale error)
            lost = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            if lost:
                raise AssertionError(f"single-process run: no gradient for {lost}")
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "grads": grads, "norms": norms}


def run_layout(rank: int, sizes: dict, moe: bool | str, num_layers: int, media: tuple = (), data: dict | None = None,
               multiplex: dict | None = None, probe=None, frozen: tuple = (), precision: str = "fp32",
               instrument=None, device_rules: str = "auto", lora: int = 0, attn_backend: str = "auto") -> dict:
    """Train STEPS steps under ``sizes`` on this rank; returns losses, grad norms and the full
    first-step gradients of the parameters this rank holds. ``multiplex``: MultiplexConfig
    fields; ``probe(pm, result)``: called after every step (to record runtime figures);
    ``instrument(pm, result)``: called once before the first step (to record inside steps).
    ``device_rules="cuda"``: the GPU's rules on the CPU (``trainer.device_rules``): the default
    attention backend, FSDP dtype and precision as on a GPU, under the strict device check,
    whose host syncs per step are returned (``host_syncs``). ``lora``: LoRA rank on the LLM.
    ``attn_backend``: ``model.attn_backend`` (auto: as the device rules take it)."""
    from torch.distributed.tensor import DTensor

    from omni.step.config import MultiplexConfig
    from omni.runtime.parallelize import parallelize
    from omni.runtime.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.layout import init_layout

    # The layout learns the precision under CUDA's rules only (FSDP's auto dtype then follows it,
    # bf16 as on a GPU); the CPU layouts keep fp32 FSDP parameters under autocast, a case of its own.
    layout = init_layout(ParallelConfig(**sizes), device="cpu", device_rules=device_rules,
                         precision=precision if device_rules == "cuda" else "auto")
    model = build(moe, num_layers, media, frozen, (data or {}).get("merge", 1), (data or {}).get("vision", "siglip"),
                  lora=lora)
    model.set_attn_backend(layout.rules.attention_backend(attn_backend))
    pm = parallelize(model, layout, MultiplexConfig(**(multiplex or {})))
    # Removed when the layout ends (the suite starts hundreds of layouts; each left a folder in /tmp).
    tmp = tempfile.TemporaryDirectory(prefix="omni-layout-")
    run_dir = tmp.name
    trainer = Trainer(pm, None, layout, TrainerConfig(max_steps=100, run_dir=run_dir, progress=False,
                                                      eval_at_end=False, precision=precision,
                                                      device_rules=device_rules),
                      OPTIM, CheckpointConfig(save_at_end=False), tokenizer=None)
    first_grads: dict = {}
    missing: list[str] = []  # trainable parameters of this rank that got no gradient
    real_sync = pm.sync_gradients

    def sync_and_capture():  # the summed gradients, before clipping
        real_sync()
        if not first_grads:
            for name, p in pm.named_parameters():
                g = p.grad
                if g is None:
                    if p.requires_grad:
                        missing.append(name)
                    continue
                first_grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()

    pm.sync_gradients = sync_and_capture
    dp, cp = layout.dp_size, layout.sizes.cp
    losses, norms, syncs = [], [], []
    result: dict = {}
    if instrument is not None:
        instrument(pm, result)
    steps = [StepBatch(step=step + 1, micro_batches=mbs[layout.dp_rank::dp])
             for step, mbs in enumerate(global_batches(96, media, **(data or {})))]
    n = len(steps)
    if layout.rules.cuda and layout.world_size > dp:
        # As a run feeds them (recipes/train.py): the peers' source rank has the loader and
        # sends each step to its TP/CP/PP peers, the media features ahead to the "device".
        from omni.runtime.data_feed import PeerFeed

        steps = PeerFeed(_Steps(steps) if layout.rank == layout.peer_source else None, layout.group("peers"),
                         layout.peer_source, cp_size=cp, cp_rank=layout.cp_rank, pad_id=0,
                         host_group=layout.group("peers_host"), device=layout.device,
                         features_on_device=layout.rules.features_on_device)
    elif cp > 1:
        steps = [replace(b, micro_batches=[slice_for_cp(mb, cp, layout.cp_rank, pad_id=0) for mb in b.micro_batches])
                 for b in steps]
    feed = iter(steps)
    padded = []
    for _ in range(n):
        with trainer.steps.strict_scope():  # as fit() fetches a step
            out = trainer.train_step(next(feed))
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
        syncs.append(out.get("host_syncs"))
        padded.append(out["padded_fraction"])
        if probe is not None:
            probe(pm, result)
    tmp.cleanup()
    if cp == 1:  # (CP ranks pad their own shards)
        result["padded"] = padded
        result["padded_expected"] = [expected_padded_fraction(mbs, dp, layout.sizes.tp, layout.sizes.pp,
                                                              one_shape=layout.config.pp_schedule == "zero_bubble")
                                     for mbs in global_batches(96, media, **(data or {}))]
    return {"losses": losses, "norms": norms, "grads": first_grads, "missing": missing, "sizes": dict(sizes),
            "host_syncs": syncs, **result}


def expected_padded_fraction(mbs: list[MicroBatch], dp: int, tp: int, pp: int, one_shape: bool) -> float:
    """A global batch's padded fraction as ``parallel.rows`` pads it (what the simulator costs):
    every DP group's rows (``mbs[g::dp]``) aligned to the same schedulable count, each row its own
    length (one length per group under torch's schedules)."""
    from parallel.rows import step_padded_fraction

    return step_padded_fraction([[mb.num_tokens for mb in mbs[g::dp]] for g in range(dp)], tp, pp, one_shape)


class _Steps:
    """A loader of fixed steps (the peers' source rank's, under ``PeerFeed``)."""

    def __init__(self, steps: list):
        self.steps = iter(steps)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.steps)

    def state_dict(self) -> dict:
        return {}


def run_named_layouts(rank: int, layouts: list, out_dir: str, probe=None, instrument=None) -> None:
    """Run ``(name, sizes, model kwargs, data kwargs, multiplex kwargs)`` layouts one after
    another on this rank and pickle the results to ``out_dir/rank<r>.pkl``. An exception ends
    this rank (its peers would wait in a collective): run_ranks then stops the others and
    re-raises it, naming the layout."""
    import pickle

    results = []
    for name, sizes, model, data, mux in layouts:
        try:
            results.append((name, run_layout(rank, sizes, data=data, multiplex=mux, probe=probe,
                                             instrument=instrument, **model), None))
        except Exception as e:
            raise RuntimeError(f"layout [{name}] failed on rank {rank}") from e
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def compare(result: dict, ref: dict, tol: float = 1e-5) -> list[str]:
    """Every mismatch of one rank's result as a line (empty: equal). A missing step or a
    trainable parameter without a gradient is a mismatch too (``covered`` checks that the
    ranks together hold every gradient)."""
    bad = []
    for key in ("losses", "norms"):
        if len(result[key]) != len(ref[key]):
            bad.append(f"{len(result[key])} {key} vs {len(ref[key])} steps of the single-process run")
    bad += [f"grad {name}: trainable, but no gradient on this rank" for name in result.get("missing", ())]
    for i, (a, b) in enumerate(zip(result["losses"], ref["losses"])):
        if not abs(a - b) <= tol * abs(b):
            bad.append(f"loss {i}: {a!r} vs single-process {b!r}")
    for i, (a, b) in enumerate(zip(result["norms"], ref["norms"])):
        if not abs(a - b) <= tol * abs(b):
            bad.append(f"grad norm {i}: {a!r} vs {b!r}")
    total = math.sqrt(sum(float(r.norm()) ** 2 for r in ref["grads"].values()))
    for name, g in result["grads"].items():
        r = ref["grads"].get(name)
        if r is None or g.shape != r.shape:
            bad.append(f"grad {name}: shape {tuple(g.shape)} vs {None if r is None else tuple(r.shape)}")
            continue
        if float(r.norm()) < 1e-7 * total:
            # Zero in exact arithmetic, roundoff here (an attention key bias: softmax ignores a
            # shift shared by all keys). A relative error of roundoff means nothing; it must
            # stay at roundoff level.
            if float(g.norm()) > 1e-6 * total:
                bad.append(f"grad {name}: {float(g.norm()):.2e} where the single-process gradient is zero")
            continue
        err = float((g.float() - r).norm() / max(float(r.norm()), 1e-12))
        if not err <= tol:
            bad.append(f"grad {name}: relative error {err:.2e}")
    if not result["grads"]:
        bad.append("no gradients captured")
    if not all(math.isfinite(x) for x in result["losses"]):
        bad.append("non-finite loss")
    # The rows ran as parallel.rows pads them (and as the simulator costs them), and the
    # metric reports it.
    for i, (got, want) in enumerate(zip(result.get("padded", ()), result.get("padded_expected", ()))):
        if not abs(got - want) <= 1e-9:
            bad.append(f"padded fraction at step {i}: {got!r} vs {want!r} from parallel.rows")
    return bad


def compare_bf16(result: dict, ref: dict, truth: dict, tol: float = BF16_TOL) -> list[str]:
    """A bf16 layout against its single-process bf16 run ``ref``, measured from the fp32 run
    ``truth`` (same model and data): losses and gradient norms within ``tol`` of ``ref``; each
    gradient no farther from the exact one than twice ``ref``'s own distance plus ``tol`` of
    it. Why not ``compare(result, ref, tol)``: a gradient built from cancellations (attention
    q/k weights of a peaked layer, a key bias that is zero in exact arithmetic) carries a bf16
    error of its own, the same size in both runs (Whisper's first q/k weights: 3.7% and 5.8%
    off the fp32 gradient in the single-process bf16 run, 3.3% and 6.4% in dp_shard=2 with bf16
    parameters, 4.1% and 6.8% apart), so the two bf16 runs differ by about that whatever the
    layout; a layout's own error (a missing or doubled contribution) moves it much farther
    from the exact gradient than that."""
    bad = [line for line in compare(dict(result, grads={}), ref, tol) if line != "no gradients captured"]
    bad += [f"grad {name}: trainable, but no gradient on this rank" for name in result.get("missing", ())]
    total = math.sqrt(sum(float(t.norm()) ** 2 for t in truth["grads"].values()))
    for name, g in result["grads"].items():
        r, t = ref["grads"].get(name), truth["grads"].get(name)
        if r is None or t is None or g.shape != t.shape:
            bad.append(f"grad {name}: shape {tuple(g.shape)} vs {None if t is None else tuple(t.shape)}")
            continue
        own, single = float((g.float() - t).norm()), float((r.float() - t).norm())
        # a millionth of the whole gradient: below it, bf16 roundoff (a gradient zero in exact arithmetic)
        if own > 2 * single + tol * float(t.norm()) + 1e-6 * total:
            bad.append(f"grad {name}: {own / max(float(t.norm()), 1e-30):.2e} off the fp32 gradient (relative), "
                       f"the single-process bf16 run {single / max(float(t.norm()), 1e-30):.2e}")
    if not result["grads"]:
        bad.append("no gradients captured")
    return bad


def covered(results: list[dict], ref: dict) -> list[str]:
    """The gradients the single-process run has that no rank captured (each rank holds its
    stage's or shard's parameters; together they hold all)."""
    held = {name for r in results for name in r["grads"]}
    return [f"grad {name}: on no rank" for name in sorted(set(ref["grads"]) - held)]


__all__ = ["reference", "run_layout", "compare", "covered", "asdict"]


def check_named_layouts(world: int, layouts: list, tmp_path, worker, extra=None) -> None:
    """Run ``layouts`` (name, sizes, model, data, multiplex) on ``world`` ranks through
    ``worker`` (which calls ``run_named_layouts``) and assert each rank's result equals its
    single-process reference (fp32 1e-5, bf16 BF16_TOL), that every layout covered every
    gradient, that an SP layout split something, plus ``extra(name, rank, sizes, mux, result)``'s
    problems."""
    from dist_helpers import rank_results, run_ranks

    refs = {}
    for _, _, model, data, _ in layouts:
        key = (tuple(sorted(model.items())), tuple(sorted(data.items())))
        if key not in refs:
            refs[key] = reference(data=data, **model)
    run_ranks(worker, world, layouts, str(tmp_path), timeout_s=120 * len(layouts))
    problems = []
    by_layout: dict[str, list] = {name: [] for name, *_ in layouts}
    for rank, results in rank_results(tmp_path, world):
        if len(results) != len(layouts):
            problems.append(f"rank {rank}: {len(results)} results for {len(layouts)} layouts")
        for (name, sizes, model, data, mux), (_, result, _) in zip(layouts, results):
            ref = refs[(tuple(sorted(model.items())), tuple(sorted(data.items())))]
            tol = BF16_TOL if model.get("precision") == "bf16" else 1e-5
            problems += [f"[{name}] rank {rank}: {line}" for line in compare(result, ref, tol)]
            by_layout[name].append(result)
            if mux.get("encoder_sp", 1) > 1 and not result.get("long_items"):
                problems.append(f"[{name}]: no item was long enough to be split (the layout tests nothing)")
            if extra is not None:
                problems += [f"[{name}] rank {rank}: {line}" for line in extra(name, rank, sizes, mux, result)]
    for name, _, model, data, _ in layouts:
        ref = refs[(tuple(sorted(model.items())), tuple(sorted(data.items())))]
        problems += [f"[{name}]: {line}" for line in covered(by_layout[name], ref)]
    assert not problems, "\n".join(problems[:40])
