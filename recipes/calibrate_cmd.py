"""`omni data calibrate`: fit the cost model's alpha/beta to measured micro-batch times.

Micro-batches are built from the configured data with varied packing (1 to 12 samples per
row, under the budget), so short and long documents and different media counts all appear;
each is timed forward+backward on the configured model and device, and
``dataloading.plan.cost.fit_cost_model`` fits the coefficients (least squares, kept >= 0).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from omegaconf import OmegaConf


def calibrate_main(overrides: list[str], micro_batches: int = 48, repeats: int = 3, out: str = "cost.yaml") -> int:
    import torch
    from tqdm import tqdm

    from dataloading.construct.constructor import SampleConstructor
    from dataloading.errors import ProblemCounter
    from dataloading.plan.cost import fit_cost_model
    from dataloading.serve.loader import build_planner
    from omni.models.build import build_model, media_processors
    from omni.models.cost import default_cost_model
    from omni.runtime.calibrate import micro_batch_work, time_micro_batches
    from recipes.compose import compose_config
    from recipes.data_plane import mixture_path, planner_kwargs
    from recipes.run_info import run_tokenizer

    cfg = OmegaConf.to_object(compose_config(overrides))
    tokenizer = run_tokenizer(cfg)
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, cfg.encoders, vocab_needed=tokenizer.vocab_size)
    processors = media_processors(model)
    mixture = mixture_path(cfg)
    planner, indices = build_planner(replace(cfg.data, mixture=mixture), tokenizer, processors, dp_size=1,
                                     **planner_kwargs(cfg, model))
    constructor = SampleConstructor({n: ix.reader(n) for n, ix in indices.items()}, tokenizer, processors,
                                    cfg.data.micro_batch_tokens, ProblemCounter("skip", 1.0),
                                    options={n: t.options for n, t in planner.tables.items()},
                                    over_budget=cfg.data.over_budget)
    rng = np.random.default_rng(cfg.trainer.seed)
    budget = cfg.data.micro_batch_tokens
    rows = []
    pool: list[str] = []
    tokens_of: dict[str, int] = {}
    while len(rows) < micro_batches:
        if len(pool) < 12:
            plan = planner.plan()
            planner.advance()
            pool += plan.rank_units(0)
            tokens_of.update(plan.unit_tokens)
        k = int(rng.integers(1, 13))
        take, used, rest = [], 0, []
        for u in pool:  # a row of up to k samples under the budget
            n = tokens_of[u]
            if len(take) < k and used + n <= budget:
                take.append(u)
                used += n
            else:
                rest.append(u)
        pool = rest
        built, _ = constructor.build_planned([take])
        rows += [mb for mb in built if mb.sample_ids]
    device = torch.device(cfg.trainer.device if cfg.trainer.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    bar = tqdm(total=len(rows), desc="timing micro-batches", unit="mb")
    times = time_micro_batches(model, rows, device, repeats=repeats, progress=bar)
    bar.close()
    template = default_cost_model(model)
    fit = fit_cost_model(template, [micro_batch_work(mb) for mb in rows], times)
    default_pred = np.array([template.sample_cost(*micro_batch_work(mb)) for mb in rows])
    # How well the FLOP-based defaults already explain the times (up to a scale and an offset).
    corr = float(np.corrcoef(default_pred, times)[0, 1]) if len(rows) > 2 else float("nan")
    fit.model.save(out, extra={"fit": {"r2": round(fit.r2, 6), "micro_batches": fit.num_points,
                                       "seconds_per_micro_batch": fit.intercept, "device": str(device),
                                       "model": cfg.name}})
    print(f"omni: {fit.summary()}")
    print(f"omni: FLOP-based defaults correlate with the times at r={corr:.3f}; fitted R^2={fit.r2:.3f}")
    print(f"omni: wrote {out}; use it with data.cost_file={out}")
    return 0
