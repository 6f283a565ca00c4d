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
    from parallel.rows import microbatch_multiple

    d = cfg.data
    return dict(seed=cfg.trainer.seed, global_batch_size=d.global_batch_size, micro_batch_tokens=d.micro_batch_tokens,
                cost_model=cost_model(cfg, model), balance=d.balance, balance_group=d.balance_group,
                over_budget=d.over_budget, micro_batch_multiple=microbatch_multiple(cfg.parallel.pp))


def build_training_loader(cfg: OmniConfig, mixture: str, tokenizer, model, processors, dp_size: int, dp_rank: int,
                          progress: bool):
    from dataloading.serve.loader import build_loader

    d = cfg.data
    return build_loader(mixture, tokenizer, processors, dp_size=dp_size, dp_rank=dp_rank, on_error=d.on_error,
                        max_skip_fraction=d.max_skip_fraction, prefetch=d.prefetch, num_workers=d.num_workers,
                        worker_timeout_s=d.worker_timeout_s, max_open_shards=d.max_open_shards,
                        backend=d.backend, ray_address=d.ray_address, ray_bind=d.ray_bind, progress=progress,
                        **planner_kwargs(cfg, model))


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
