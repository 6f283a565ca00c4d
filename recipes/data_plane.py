"""Wiring of the data plane for `omni train`, `omni data plan` and `omni data calibrate`:
the mixture file (the demo's when none is given), the cost model, the planner and the loader."""
from __future__ import annotations

from recipes.schema import OmniConfig


def mixture_path(cfg: OmniConfig, is_main: bool = True, progress: bool = True, barrier=None) -> str:
    """data.mixture, or the demo dataset's mixture (generated on first use by the main rank)."""
    if cfg.data.mixture is not None:
        return cfg.data.mixture
    from dataloading.demo import ensure_demo_dataset

    if cfg.data.demo_mixture not in ("mixture", "vision", "chat"):  # before generating anything
        from omni.errors import ConfigError

        raise ConfigError(f"data.demo_mixture={cfg.data.demo_mixture!r}: the demo has 'mixture' (shapes, tones, text), "
                          "'vision' (shapes, text) and 'chat' (conversations about shapes)")
    if is_main:
        ensure_demo_dataset(scale=cfg.data.demo_scale, progress=progress)
    if barrier is not None:
        barrier()  # the other ranks then find it in the cache
    return str(ensure_demo_dataset(scale=cfg.data.demo_scale, progress=False) / f"{cfg.data.demo_mixture}.yaml")


def cost_model(cfg: OmniConfig, model):
    """The calibrated cost file when given, else FLOP-based defaults from the model config."""
    from dataloading.plan.cost import CostModel
    from omni.models.cost import default_cost_model

    return CostModel.load(cfg.data.cost_file) if cfg.data.cost_file else default_cost_model(model)


def planner_kwargs(cfg: OmniConfig, model) -> dict:
    """What ``build_planner`` and ``build_loader`` take beside ``cfg.data``: the seed, the cost
    model and the pipeline's micro-batch multiple."""
    from parallel.rows import microbatch_multiple

    return dict(seed=cfg.trainer.seed, cost_model=cost_model(cfg, model),
                micro_batch_multiple=microbatch_multiple(cfg.parallel.pp))


def build_training_loader(cfg: OmniConfig, mixture: str, tokenizer, model, processors, dp_size: int, dp_rank: int,
                          progress: bool):
    from dataclasses import replace

    from dataloading.serve.loader import build_loader

    return build_loader(replace(cfg.data, mixture=mixture), tokenizer, processors, dp_size=dp_size, dp_rank=dp_rank,
                        progress=progress, **planner_kwargs(cfg, model))


def model_for_planning(cfg: OmniConfig, vocab_size: int):
    """The model's structure without its weights (meta device): enough for processors and costs.
    With model.pretrained, the architecture comes from its config.json alone: no weight is read
    (and none could be copied into meta tensors)."""
    from dataclasses import fields, replace

    import torch

    from omni.models.build import build_model
    from recipes.checks import pretrained_architecture

    model_cfg = cfg.model
    if model_cfg.pretrained:
        arch = pretrained_architecture(model_cfg.pretrained)
        model_cfg = replace(model_cfg, pretrained=None, **{f.name: getattr(arch, f.name) for f in fields(arch)})
        # Planning needs no embedding rows; the vocabulary is checked against the tokenizer at training.
        vocab_size = min(vocab_size, arch.vocab_size)
    with torch.device("meta"):
        return build_model(model_cfg, cfg.encoders, vocab_needed=vocab_size)
