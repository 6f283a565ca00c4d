"""Every value check of a composed config that needs no data, no weights and no process group.

``omni train``, ``omni data plan``, ``omni data calibrate`` and the Python API
(``recipes.compose.compose_config``, ``recipes.train.run``) all come through ``check_config``, so a
bad value ends in one ``omni: error:`` line that names the key and the fix before anything slow
starts (no index is read, no model is built). The allowed values are the runtime's own
constants, imported from where they are used; a rule the runtime already states (the layout's
sizes, the decoder's shape rules, the guards' limits) is called here, not restated.
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Iterable

from omni.errors import ConfigError
from recipes.schema import OmniConfig


def one_of(key: str, value, allowed: Iterable) -> None:
    """``value`` must be one of ``allowed``; the error suggests the closest spelling."""
    allowed = [str(a) for a in allowed]
    if str(value) in allowed:
        return
    close = difflib.get_close_matches(str(value), allowed, n=1, cutoff=0.5)
    hint = f"; did you mean {key}={close[0]}?" if close else f"; use {key}={allowed[0]}, for example"
    raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")


def _need(ok: bool, key: str, value, rule: str, fix: str = "") -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {rule}{'; ' + fix if fix else ''}")


def _positive(key: str, value, integer: bool = True, fix: str = "") -> None:
    _need(value > 0 and (not integer or int(value) == value), key, value, "must be >= 1" if integer else "must be > 0",
          fix)


def _at_least(key: str, value, low) -> None:
    _need(value >= low, key, value, f"must be >= {low}")


def _fraction(key: str, value) -> None:
    _need(0.0 <= value <= 1.0, key, value, "must be in [0, 1]")


def check_config(cfg: OmniConfig, world_size: int | None = None) -> None:
    """Raise a user error (one line: key, problem, fix; ``ConfigError``, or the ``LayoutError`` /
    ``UserError`` of the rule called) for the first bad value of ``cfg``.
    ``world_size``: the launched ranks, for the layout's size rules (None: not checked, e.g.
    ``omni data plan``, which plans for ``--dp`` ranks)."""
    _trainer(cfg)
    _optim(cfg)
    _checkpoint(cfg)
    _data(cfg)
    arch = _model(cfg)
    _encoders(cfg)
    _modules(cfg)
    check_multiplex(cfg)
    _parallel(cfg, arch, world_size)


def _trainer(cfg: OmniConfig) -> None:
    import torch

    from omni.runtime.config import DEVICE_RULES, TRAINER_PRECISIONS
    from parallel.device_rules import resolve_device_rules
    from omni.runtime.guards import BadStepGuard, SpikeDetector

    t = cfg.trainer
    _positive("trainer.max_steps", t.max_steps, fix="the number of optimizer steps, e.g. trainer.max_steps=100")
    if t.stop_at is not None:
        _need(1 <= t.stop_at, "trainer.stop_at", t.stop_at, "must be >= 1", "or null to run to trainer.max_steps")
    if t.device != "auto":
        try:
            torch.device(t.device)
        except (RuntimeError, ValueError):
            one_of("trainer.device", t.device, ("auto", "cpu", "cuda", "cuda:0"))
    one_of("trainer.precision", t.precision, TRAINER_PRECISIONS)
    one_of("trainer.device_rules", t.device_rules, DEVICE_RULES)
    device = t.device if t.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    # the stated memory and, under CUDA's rules on the CPU, the interpreted Triton kernels
    resolve_device_rules(t.device_rules, torch.device(device), t.precision,
                         t.device_memory_gib).attention_backend(cfg.model.attn_backend)
    _positive("trainer.log_every", t.log_every)
    _trackers(t)
    _at_least("trainer.eval_every", t.eval_every, 0)
    _at_least("trainer.eval_samples", t.eval_samples, 0)
    _positive("trainer.eval_batch_size", t.eval_batch_size)
    _positive("trainer.eval_max_gib", t.eval_max_gib)
    _positive("trainer.max_new_tokens", t.max_new_tokens)
    _at_least("trainer.hang_timeout_s", t.hang_timeout_s, 0)
    BadStepGuard(t.max_bad_steps)
    SpikeDetector(t.loss_spike_sigmas, t.loss_spike_window)


def _trackers(t) -> None:
    """``trainer.log_to``: known names, and the package of each one installed (one line naming
    the extra), before training starts rather than at its first metrics line."""
    from omni.runtime.trackers import TRACKERS, WANDB_MODES, missing_package, tracker_names

    for name in t.log_to:
        if name not in TRACKERS:
            close = difflib.get_close_matches(str(name), TRACKERS, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}?" if close else "e.g. trainer.log_to=[jsonl,tensorboard]"
            raise ConfigError(f"trainer.log_to lists {name!r}, which is not one of {', '.join(TRACKERS)}; {hint}")
    if t.wandb.mode is not None:
        one_of("trainer.wandb.mode", t.wandb.mode, WANDB_MODES)
    for name in tracker_names(t):
        problem = missing_package(name)
        if problem:
            raise ConfigError(problem)


def _optim(cfg: OmniConfig) -> None:
    o = cfg.optim
    _need(o.lr > 0 and math.isfinite(o.lr), "optim.lr", o.lr, "must be a positive number", "e.g. optim.lr=3e-4")
    _need(o.eps > 0, "optim.eps", o.eps, "must be > 0", "e.g. optim.eps=1e-8")
    _need(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "optim.betas", list(o.betas),
          "must be two numbers in [0, 1)", "e.g. optim.betas=[0.9,0.95]")
    _at_least("optim.weight_decay", o.weight_decay, 0)
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    _fraction("optim.min_lr_ratio", o.min_lr_ratio)
    _need(o.clip_grad_norm >= 0, "optim.clip_grad_norm", o.clip_grad_norm, "must be >= 0", "0 disables clipping")


def _checkpoint(cfg: OmniConfig) -> None:
    from omni.runtime.checkpoint_manifest import VERIFY_MODES
    from omni.runtime.config import RESUME_CHOICES

    c = cfg.checkpoint
    one_of("checkpoint.verify", c.verify, VERIFY_MODES)
    _at_least("checkpoint.every", c.every, 0)
    _at_least("checkpoint.keep_last", c.keep_last, 0)
    if c.resume not in RESUME_CHOICES and not Path(c.resume).expanduser().exists():
        close = difflib.get_close_matches(c.resume, RESUME_CHOICES, n=1, cutoff=0.5)
        fix = f"did you mean checkpoint.resume={close[0]}?" if close else \
            f"use {', '.join(RESUME_CHOICES)} or the path of a checkpoint folder"
        raise ConfigError(f"checkpoint.resume={c.resume!r} is neither {' nor '.join(RESUME_CHOICES)} nor an "
                          f"existing checkpoint folder; {fix}")


def _data(cfg: OmniConfig) -> None:
    from dataloading.errors import ON_ERROR_POLICIES
    from dataloading.plan.balance import METHODS
    from dataloading.plan.mixture import OVER_BUDGET_POLICIES
    from dataloading.serve.loader import BACKENDS

    d = cfg.data
    _positive("data.global_batch_size", d.global_batch_size)
    _positive("data.micro_batch_tokens", d.micro_batch_tokens)
    _at_least("data.num_workers", d.num_workers, 0)
    _positive("data.prefetch", d.prefetch)
    _at_least("data.worker_timeout_s", d.worker_timeout_s, 0)
    _positive("data.max_open_shards", d.max_open_shards)
    one_of("data.balance", d.balance, METHODS)
    _at_least("data.balance_group", d.balance_group, 0)
    one_of("data.over_budget", d.over_budget, OVER_BUDGET_POLICIES)
    one_of("data.backend", d.backend, BACKENDS)
    one_of("data.on_error", d.on_error, ON_ERROR_POLICIES)
    _fraction("data.max_skip_fraction", d.max_skip_fraction)
    _positive("data.demo_scale", d.demo_scale, integer=False)
    # The demo's conversations need a chat template, which the byte tokenizer has not.
    _need(not (d.mixture is None and d.demo_mixture == "chat" and d.tokenizer == "byte" and not d.chat_template),
          "data.demo_mixture", "chat", "holds conversations, and the byte tokenizer has no chat template",
          "add data.chat_template=plain")


def _model(cfg: OmniConfig):
    """The backbone's architecture (config.json's when model.pretrained is set), checked."""
    from omni.kernels import BACKENDS
    from omni.models import lora
    from omni.models.llm.config import FAMILIES

    m = cfg.model
    one_of("model.attn_backend", m.attn_backend, BACKENDS)
    lora.check(m.lora, cfg.encoders)
    if m.pretrained:
        return pretrained_architecture(m.pretrained)
    one_of("model.family", m.family, FAMILIES)
    try:
        m.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return m


def pretrained_architecture(path: str):
    """The backbone config of a Hugging Face checkpoint folder, from its config.json alone."""
    from omni.models.hf_io import read_decoder_config

    try:
        return read_decoder_config(path)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"model.pretrained={path}: {exc}") from None


def _encoders(cfg: OmniConfig) -> None:
    from omni.models.encoders.registry import get_encoder_class
    from omni.models.projector import ACTIVATIONS

    for slot_name, slot in cfg.encoders.items():
        try:
            cls = get_encoder_class(slot._target_ or slot.name)
            if not slot.pretrained:  # with a checkpoint, params override its config.json (read at build)
                cls.build_config(dict(slot.params))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"encoders.{slot_name}: {exc}") from None
        one_of(f"encoders.{slot_name}.projector.activation", slot.projector.activation, sorted(ACTIVATIONS))
        _need(slot.projector.hidden_mult > 0, f"encoders.{slot_name}.projector.hidden_mult",
              slot.projector.hidden_mult, "must be > 0")


def _modules(cfg: OmniConfig) -> None:
    """What names modules (model.freeze, trainer.stages, optim.groups; omni/models/freeze.py)
    and model.init_from."""
    from omni.models.freeze import ModuleNames, frozen_units
    from omni.runtime.optim import GroupPlan
    from omni.runtime.stages import check_stages
    from recipes.model_source import init_checkpoint

    names = ModuleNames.of_config(cfg.encoders)
    try:
        check_stages(cfg.trainer.stages, names, frozen_units(names, cfg.model.freeze, cfg.encoders))
        GroupPlan(cfg.optim, names)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.model.init_from:
        init_checkpoint(cfg.model.init_from)


def check_multiplex(cfg) -> None:
    """The ``multiplex`` group on its own (training's config and ``omni simulate``'s share it)."""
    from omni.step.multiplex_rules import BUBBLE_SETTINGS, PLACEMENTS, WEIGHT_MODES, check_shard_group_setting, \
        chunks_per_cut_setting, memory_budget_setting
    from parallel.reshard import EXCHANGE_MODES

    x = cfg.multiplex
    one_of("multiplex.placement", x.placement, PLACEMENTS)
    one_of("multiplex.encoder_weights", x.encoder_weights, WEIGHT_MODES)
    try:
        check_shard_group_setting(x.encoder_weights, x.encoder_shard_group)
    except ValueError as exc:  # the runtime's LayoutError, a config mistake here
        raise ConfigError(str(exc)) from None
    _positive("multiplex.encoder_sp", x.encoder_sp)
    try:
        chunks_per_cut_setting(x.chunks_per_cut)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _at_least("multiplex.trace_step", x.trace_step, 0)
    _at_least("multiplex.timeline_every", x.timeline_every, 1)
    threshold = str(x.long_threshold).lower()
    _need(threshold == "auto" or (threshold.isdigit() and int(threshold) > 0), "multiplex.long_threshold",
          x.long_threshold, "must be auto or a positive number of encoder tokens")
    memory_budget_setting(x.encoder_memory_mib)
    one_of("multiplex.exchange", x.exchange, EXCHANGE_MODES)
    _need(isinstance(x.lookahead, int) and not isinstance(x.lookahead, bool) and x.lookahead >= 0,
          "multiplex.lookahead", x.lookahead, "must be a whole number of cut groups >= 0", "0 turns it off")
    one_of("multiplex.fill_bubbles", str(x.fill_bubbles).lower(), BUBBLE_SETTINGS)


def _parallel(cfg: OmniConfig, arch, world_size: int | None) -> None:
    from parallel.layout import (CHECKPOINT_MODES, CP_IMPLS, PP_SCHEDULES, PRECISIONS, RESHARD_CHOICES,
                                 check_model_fits, check_options, check_sequence, resolve_sizes)

    p = cfg.parallel
    one_of("parallel.pp_schedule", p.pp_schedule, PP_SCHEDULES)
    one_of("parallel.cp_impl", p.cp_impl, CP_IMPLS)
    one_of("parallel.activation_checkpoint", p.activation_checkpoint, CHECKPOINT_MODES)
    one_of("parallel.encoder_activation_checkpoint", p.encoder_activation_checkpoint, CHECKPOINT_MODES)
    one_of("parallel.mixed_precision", p.mixed_precision, PRECISIONS)
    one_of("parallel.reshard_after_forward", str(p.reshard_after_forward).lower(), RESHARD_CHOICES)
    one_of("parallel.fsdp_reduce_every_microbatch", str(p.fsdp_reduce_every_microbatch).lower(), RESHARD_CHOICES)
    check_options(p)
    if p.fp8:
        import importlib.util

        _need(importlib.util.find_spec("torchao") is not None, "parallel.fp8", p.fp8,
              "needs torchao, which is not installed", 'pip install -e ".[fp8]", or parallel.fp8=false')
    if world_size is None:
        return
    sizes = resolve_sizes(p, world_size)
    check_model_fits(sizes, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, num_layers=arch.num_layers,
                     num_experts=arch.num_experts, virtual_stages=p.pp_virtual_stages if sizes.pp > 1 else 1,
                     cp_impl=p.cp_impl, activation_offload=p.activation_offload,
                     fp8=p.fp8, hidden_size=arch.hidden_size)
    check_sequence(sizes, cfg.data.micro_batch_tokens)
    if cfg.encoders:
        _multiplex_on_layout(cfg, sizes)


def _multiplex_on_layout(cfg: OmniConfig, sizes) -> None:
    """The multiplex config's rules on this layout, the runtime's own (``check_multiplex_layout``:
    encoder SP blocks, the hybrid shard group, ``fill_bubbles=true`` where it cannot apply, the
    pipeline schedule a placement needs)."""
    from omni.step.multiplex_rules import check_multiplex_layout

    try:
        check_multiplex_layout(cfg.multiplex, sizes, cfg.parallel.gpus_per_node, cfg.parallel.pp_schedule)
    except ValueError as exc:  # the runtime's LayoutError, a config mistake here
        raise ConfigError(str(exc)) from None
