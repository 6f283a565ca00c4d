"""`omni data plan`: a dry run of the data plane — what every DP rank would get, step by step.

Reads only the metadata index (no tar is opened, no model weights are made): per step the
balance (max/mean cost over ranks vs. the lower bound), the packing utilisation and the
mixture shares; ``--json`` prints one object per step with every rank's cost, tokens and
sample ids.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf


def _state_from_file(path: str) -> dict:
    """A planner state: saved by --save-state, or a training checkpoint's trainer_state.pt.

    A .pt file is read with ``torch.load(weights_only=True)``: omni's trainer_state.pt holds only
    numbers, strings, lists and dicts, and a file that needs anything else unpickled (which could
    run code) is refused with a one-line error instead."""
    from dataloading.errors import DataError

    p = Path(path)
    if not p.is_file():
        raise DataError(f"--load-state {p}: no such file; pass a file written by --save-state or a "
                        f"checkpoint's trainer_state.pt", kind="config")
    if p.suffix == ".pt":
        import pickle

        import torch

        try:
            sd = torch.load(p, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise DataError(f"--load-state {p}: not a trainer_state.pt that omni wrote (it asks to unpickle "
                            f"objects other than plain numbers, strings, lists and dicts, which omni refuses "
                            f"to do); pass a checkpoint's trainer_state.pt or a --save-state file",
                            kind="config") from None
        except (EOFError, KeyError, RuntimeError, ValueError) as e:
            raise DataError(f"--load-state {p}: cannot be read as a torch file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'truncated or empty'}); pass a checkpoint's "
                            f"trainer_state.pt or a --save-state file", kind="config") from None
        if isinstance(sd, dict):
            sd = sd.get("loader", sd)
    else:
        sd = json.loads(p.read_text())
    if not isinstance(sd, dict):
        raise DataError(f"--load-state {p}: holds a {type(sd).__name__}, not a planner state; pass a "
                        f"checkpoint's trainer_state.pt or a --save-state file", kind="config")
    return sd.get("planner", sd)


def plan_main(overrides: list[str], dp: int, steps: int, balance: str | None = None, as_json: bool = False,
              save_state: str | None = None, load_state: str | None = None, out=None) -> int:
    from dataloading.serve.loader import build_planner
    from omni.models.build import media_processors
    from recipes.compose import compose_config
    from recipes.data_plane import mixture_path, model_for_planning, planner_kwargs
    from recipes.run_info import run_tokenizer

    out = out or sys.stdout
    cfg = OmegaConf.to_object(compose_config(overrides))
    if balance is not None:
        from dataloading.plan.balance import METHODS
        from recipes.checks import one_of

        one_of("--balance", balance, METHODS)
    tokenizer = run_tokenizer(cfg)
    model = model_for_planning(cfg, tokenizer.vocab_size)
    mixture = mixture_path(cfg, progress=not as_json)
    if cfg.data.mixture is None:
        # On stderr, so that --json output stays one object per line.
        print(f"omni data plan: no data.mixture given, so this plans the demo mixture {mixture}; plan your own "
              f"with `omni data plan data.mixture=/path/to/mix.yaml` (docs/data.md)", file=sys.stderr, flush=True)
    data = replace(cfg.data, mixture=mixture, balance=cfg.data.balance if balance is None else balance)
    planner, _ = build_planner(data, tokenizer, media_processors(model), dp_size=dp, progress=not as_json,
                               **planner_kwargs(cfg, model))
    if load_state:
        planner.load_state_dict(_state_from_file(load_state))
    rows, padded = [], []
    for _ in range(steps):
        plan = planner.plan()
        planner.advance()
        padded.append(_padded_fraction(plan, cfg.parallel))
        if as_json:
            out.write(json.dumps({**plan.to_json(), "padded_fraction": padded[-1]}, separators=(",", ":")) + "\n")
        rows.append(plan)
    if not as_json:
        _print_table(rows, padded, planner, data.balance, dp, mixture, out, cfg.parallel)
    if save_state:
        Path(save_state).write_text(json.dumps(planner.state_dict(), indent=1))
        if not as_json:
            out.write(f"planner state after step {planner.step - 1} saved to {save_state}; continue with "
                      f"--load-state {save_state}\n")
    return 0


def _padded_fraction(plan, par) -> float:
    """Of the LLM rows this step would run, the share that is padding (``parallel.rows``: under
    PP every rank runs the same multiple of pp, each row its own length): as the trainer pads
    (``padded_fraction`` in metrics.jsonl) and the simulator costs."""
    from parallel.rows import step_padded_fraction

    rows = [[sum(plan.unit_tokens.get(u, 0) for u in mb) for mb in mbs] for mbs in plan.ranks]
    return step_padded_fraction(rows, par.tp, par.pp, one_shape=par.pp > 1 and par.pp_schedule == "zero_bubble")


def _print_table(plans, padded, planner, balance: str, dp: int, mixture: str, out, par) -> None:
    names = planner.names
    weights = {n: [] for n in names}
    out.write(f"omni data plan: {mixture}, dp={dp}, balance={balance}, budget={planner.packing.budget} tokens, "
              f"global batch {planner.global_batch_size}; padded rows as tp={par.tp} x pp={par.pp} runs them\n\n")
    share_cols = " | ".join(f"{n} %" for n in names)
    out.write(f"| step | max/mean | lower bound | utilisation | micro-batches | padded % | skipped | {share_cols} |\n")
    out.write("|" + "---|" * (7 + len(names)) + "\n")
    totals = {n: 0 for n in names}
    for p, pad in zip(plans, padded):
        total = sum(p.sources.values())
        probs = dict(zip(names, planner.probabilities(p.step)))
        for n in names:
            totals[n] += p.sources.get(n, 0)
            weights[n].append(probs[n])
        shares = " | ".join(f"{100 * p.sources.get(n, 0) / total:.1f}" for n in names)
        skipped = sum(p.skipped.values())
        out.write(f"| {p.step} | {p.stats['max_over_mean']:.3f} | {p.stats['lower_bound']:.3f} | "
                  f"{p.stats.get('utilisation', 1.0):.3f} | {p.stats['micro_batches']} | {100 * pad:.1f} | {skipped} | "
                  f"{shares} |\n")
    ratios = [p.stats["max_over_mean"] for p in plans]
    bounds = [p.stats["lower_bound"] for p in plans]
    drawn = sum(totals.values())
    out.write(f"\nsummary over {len(plans)} steps: max/mean mean {sum(ratios) / len(ratios):.3f}, worst "
              f"{max(ratios):.3f} (lower bound mean {sum(bounds) / len(bounds):.3f}); utilisation mean "
              f"{sum(p.stats.get('utilisation', 1.0) for p in plans) / len(plans):.3f}; padded rows "
              f"{100 * sum(padded) / len(padded):.1f}%\n")
    out.write("mixture: " + ", ".join(
        f"{n} {100 * totals[n] / drawn:.1f}% (target {100 * sum(weights[n]) / len(weights[n]):.1f}%)"
        for n in names) + "\n")
