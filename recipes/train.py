"""`omni train`: compose the config, build layout, tokenizer, model and data, then run."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from recipes.compose import compose_config
from recipes.schema import OmniConfig


def train_main(overrides: list[str], print_cfg: bool = False) -> int:
    dcfg = compose_config(overrides)
    if print_cfg:
        from recipes.run_info import shown_config

        print(shown_config(dcfg))
        return 0
    cfg: OmniConfig = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    run(cfg)
    return 0


def run(cfg: OmniConfig):
    """Build everything from a composed config and train; returns the trainer's FitResult."""
    from dataloading.construct.held_out import EvalSet, eval_options
    from dataloading.plan.mixture import load_mixture
    from omni.models.build import build_meta_model, media_processors
    from omni.runtime.trainer import Trainer
    from omni.runtime.parallelize import parallelize
    from parallel.layout import barrier, check_sequence, describe, init_layout, launched_world_size, shutdown
    from recipes.checks import check_config
    from recipes.data_plane import mixture_path
    from recipes.model_source import init_checkpoint
    from omni.models.freeze import ModuleNames
    from recipes.run_info import describe_training, record_run, run_tokenizer
    from recipes.threads import set_threads

    check_config(cfg, world_size=launched_world_size())
    # Before any parallel work (torch sizes its inter-op pool once); the inline backend's data
    # workers build steps beside the rank's compute, Ray's constructors run in their own actors.
    threads_before = torch.get_num_threads()
    threads = set_threads(cfg.data.num_workers if cfg.data.backend == "inline" else 0)
    t = cfg.trainer
    layout = init_layout(cfg.parallel, device=t.device, device_rules=t.device_rules, precision=t.precision,
                         device_memory_gib=t.device_memory_gib)
    try:
        show = cfg.trainer.progress and layout.is_main
        tokenizer = run_tokenizer(cfg)
        check_sequence(layout.sizes, cfg.data.micro_batch_tokens)

        def meta_model():
            # On the meta device (no storage); the weights are a function of (seed, name, shape)
            # or the checkpoint's, and each rank materialises only its part (parallelize).
            return build_meta_model(cfg.model, cfg.encoders, vocab_needed=tokenizer.vocab_size,
                                    seed=cfg.trainer.seed)

        torch.manual_seed(cfg.trainer.seed)  # the run's own randomness; the weights take the seed directly
        model, weights = meta_model()
        # model.attn_backend=auto as the device's rules take it (the varlen kernels under CUDA's)
        model.set_attn_backend(layout.rules.attention_backend(cfg.model.attn_backend))
        processors = media_processors(model)
        mixture = mixture_path(cfg, layout.is_main, show, barrier)
        # The held-out set: data.eval_dir, else the mixture file's own `eval:` folder.
        training_mixture = load_mixture(mixture)
        eval_dir = cfg.data.eval_dir or training_mixture.eval
        validator = _validator(cfg, layout, eval_dir, tokenizer, processors, training_mixture)
        loader = _loader(cfg, layout, mixture, tokenizer, model, processors, show)
        n_params = sum(p.numel() for p in model.parameters())
        modules = ModuleNames.of_config(cfg.encoders)  # model.freeze / trainer.stages / optim.groups names
        training = describe_training(model, modules, cfg.model.lora)  # before parallelize shards it
        from recipes.data_plane import cost_model

        pm = parallelize(model, layout, cfg.multiplex, cost_model(cfg, model), weights=weights)
        run_dir = Path(cfg.trainer.run_dir)
        if layout.is_main:
            record_run(cfg, run_dir, tokenizer, model.llm.config, n_params, describe(layout.sizes), mixture,
                       training, threads.describe())

        def eval_samples():
            # Prompted as the model was trained: each sub-folder with its training source's
            # chat template and media options (dataloading.construct.held_out.eval_options).
            return EvalSet(eval_dir, tokenizer, processors, limit=cfg.trainer.eval_samples,
                           options=eval_options(training_mixture.sources))

        trainer = Trainer(
            pm,
            loader,
            layout,
            cfg.trainer,
            cfg.optim,
            cfg.checkpoint,
            tokenizer=tokenizer,
            eval_samples=eval_samples if (cfg.trainer.eval_at_end and eval_dir) else None,
            full_model=lambda: meta_model()[0],
            trace_step=cfg.multiplex.trace_step,
            validator=validator,
            run_config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
            modules=modules,
            init_from=init_checkpoint(cfg.model.init_from) if cfg.model.init_from else None,
        )
        try:
            result = trainer.fit()
        finally:
            loader.close()
        _closing_lines(cfg, layout, trainer.checkpointer, loader)
        return result
    finally:
        shutdown()
        torch.set_num_threads(threads_before)  # a run called from Python leaves its process's threads


def _closing_lines(cfg: OmniConfig, layout, checkpointer, loader) -> None:
    """Rank 0's last words: where the checkpoints are, and what ``data.on_error=skip`` let
    through, summed over the data-parallel ranks (each rank's loader counts its own samples)."""
    from dataloading.serve.loader import skipped_summary
    from parallel.layout import host_group

    mine = dict(getattr(loader, "problems", None) or {}) if layout.rank == layout.peer_source else None
    per_rank = [mine]
    if layout.world_size > 1:
        import torch.distributed as dist

        per_rank = [None] * layout.world_size if layout.is_main else None
        dist.gather_object(mine, per_rank, dst=0, group=host_group(layout))
    if not layout.is_main:
        return
    checkpoints = checkpointer.completed()
    if checkpoints:
        print(f"omni: checkpoints in {checkpoints[-1].parent} (latest step {_step_of(checkpoints[-1])})", flush=True)
    line = skipped_summary([p for p in per_rank if p], Path(cfg.trainer.run_dir) / "metrics.jsonl")
    if line:
        print(line, flush=True)


def _step_of(checkpoint: Path) -> int:
    from omni.runtime.checkpoint_files import PREFIX

    return int(checkpoint.name[len(PREFIX):])


def _validator(cfg: OmniConfig, layout, eval_dir, tokenizer, processors, training_mixture):
    """``trainer.eval_every``: the held-out set as validation micro-batches, built here on every
    rank (the same list everywhere), so a bad held-out sample stops the run before training."""
    if not cfg.trainer.eval_every:
        return None
    from dataloading.construct.held_out import ValidationSet, eval_options
    from omni.errors import UserError
    from omni.runtime.validation import Validator

    if not eval_dir:
        raise UserError(f"trainer.eval_every={cfg.trainer.eval_every} needs a held-out folder: set data.eval_dir, "
                        "or an eval: folder in the mixture file, or trainer.eval_every=0")
    held_out = ValidationSet(eval_dir, tokenizer, processors, cfg.data.micro_batch_tokens, cfg.data.over_budget,
                             limit=cfg.trainer.eval_samples, options=eval_options(training_mixture.sources))
    return Validator(held_out.batches(), layout, cfg.trainer.eval_every, getattr(tokenizer, "pad_id", None) or 0)


def _loader(cfg: OmniConfig, layout, mixture, tokenizer, model, processors, show):
    """One loader per data-parallel rank: its lowest rank runs it and broadcasts each step to the
    TP/CP/PP peers, which keep their context-parallel slice."""
    from omni.runtime.data_feed import PeerFeed
    from recipes.data_plane import build_training_loader

    source = layout.peer_source
    loader = None
    if layout.rank == source:
        loader = build_training_loader(cfg, mixture, tokenizer, model, processors, layout.dp_size, layout.dp_rank,
                                       show)
    if layout.world_size == layout.dp_size:
        return loader  # no peers
    return PeerFeed(loader, layout.group("peers"), source, cp_size=layout.sizes.cp, cp_rank=layout.cp_rank,
                    pad_id=getattr(tokenizer, "pad_id", None) or 0, host_group=layout.group("peers_host"),
                    device=layout.device, features_on_device=layout.rules.features_on_device)
