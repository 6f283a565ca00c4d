"""``omni simulate``: predicted step time, MFU, bubbles and memory per placement
(docs/simulate.md). ``--calibrate TRACE`` fits the cluster's efficiency factors to a measured
run instead."""
from __future__ import annotations

import json
import sys

from omegaconf import OmegaConf


def load_sim_config(overrides: list[str], notes: list[str] | None = None):
    """The composed ``conf/simulate.yaml`` as a SimConfig (typos in overrides name the key).
    ``notes`` gets one line per workload setting the chosen towers have no use for."""
    from omni.sim.calibrate import apply_calibration
    from omni.sim.workload import apply_encoder_params
    from recipes.checks import check_multiplex
    from recipes.compose import compose_config

    cfg = OmegaConf.to_object(compose_config(overrides, config_name="simulate"))
    cfg.parallel.gpus_per_node = cfg.cluster.gpus_per_node  # the cluster says how wide a node is
    skipped = apply_encoder_params(cfg, overrides)
    if notes is not None:
        notes += skipped
    check_multiplex(cfg)  # training's own checks of the group, before any simulation
    _fold_frozen_encoders(cfg)
    if cfg.sim.calibration:
        cfg.cluster = apply_calibration(cfg.cluster, cfg.sim.calibration)
    return cfg


def _fold_frozen_encoders(cfg) -> None:
    """``model.freeze``'s encoders become their slots' ``freeze`` (what the simulator models: no
    encoder backward, gradients or optimizer state). A frozen LLM or projector and LoRA are not
    modelled: rather than cost them as full training, one line says so."""
    from omni.errors import ConfigError
    from omni.models.freeze import ModuleNames, frozen_units

    if cfg.model.lora.rank:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank}: the simulator does not model LoRA (it would cost "
                          "full training of the LLM); set model.lora.rank=0")
    names = ModuleNames.of_config(cfg.encoders)
    try:
        units = frozen_units(names, cfg.model.freeze, cfg.encoders)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    unmodelled = sorted(u for u in units if not u.startswith("encoder."))
    if unmodelled:
        raise ConfigError(f"model.freeze={list(cfg.model.freeze)}: the simulator models frozen encoders only, not "
                          f"{', '.join(unmodelled)} (it would cost them as training); leave them out of model.freeze")
    for unit in units:
        cfg.encoders[unit.split(".", 1)[1]].freeze = True


def simulate_main(overrides: list[str], as_json: bool = False, calibrate: str | None = None,
                  out_file: str | None = None, plot: str | None = None, out=None) -> int:
    out = out or sys.stdout
    notes: list[str] = []
    cfg = load_sim_config(overrides, notes)
    if calibrate:
        from omni.sim.calibrate import calibrate_from_trace

        fit = calibrate_from_trace(cfg, calibrate)
        text = fit.to_yaml()
        if out_file:
            from pathlib import Path

            Path(out_file).write_text(text)
        out.write(json.dumps(fit.to_dict(), indent=1) + "\n" if as_json else fit.summary() + "\n")
        return 0
    from omni.sim.compare import simulate

    progress = None if as_json else (lambda p: print(f"simulating {p} ...", file=sys.stderr, flush=True))
    result = simulate(cfg, progress=progress)
    result["name"] = cfg.name
    result["workload"]["notes"] = notes
    _say_warnings(result)
    if plot:
        from omni.sim.plot import plot_simulation

        plot_simulation(result, plot)
    if as_json:
        out.write(json.dumps(result, separators=(",", ":")) + "\n")
    else:
        out.write(format_report(result) + "\n")
    return 0


def format_report(result: dict) -> str:
    from omni.sim.report import placement_table

    return placement_table(result)


def plan_main(overrides: list[str], as_json: bool = False, top: int | None = None, placement: str = "colocated",
              plot: str | None = None, out=None) -> int:
    from omni.sim.config import PLACEMENTS
    from omni.sim.search import plan_layouts
    from omni.errors import ConfigError

    out = out or sys.stdout
    if placement not in PLACEMENTS:
        raise ConfigError(f"--placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    notes: list[str] = []
    cfg = load_sim_config(overrides, notes)
    bar = None
    if not as_json:
        from tqdm import tqdm

        bar = tqdm(desc="simulating layouts", unit="layout", file=sys.stderr, leave=False)

    def progress(i: int, n: int) -> None:
        bar.total = n
        bar.update(1)

    result = plan_layouts(cfg, placement=placement, top_k=top, progress=progress if bar is not None else None)
    if bar is not None:
        bar.close()
    result["workload"]["notes"] = notes
    _say_warnings(result)
    if plot:
        from omni.sim.plot import plot_plan

        plot_plan(result, plot, cfg.name)
    if as_json:
        out.write(json.dumps(result, separators=(",", ":")) + "\n")
        return 0
    from omni.sim.report import plan_table

    out.write(plan_table(result, cfg.name) + "\n")
    return 0


def _say_warnings(result: dict) -> None:
    """The layout checks' warnings, each once with its count (after any progress bar)."""
    for line in result.get("warnings", []):
        print(line, file=sys.stderr, flush=True)
