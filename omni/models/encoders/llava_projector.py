"""LLaVA's ``multi_modal_projector`` in a checkpoint: where its tensors sit and under which names,
which activations it may have, and loading it as Omni's projector (LLaVA's MLP is Omni's
``Projector`` without a merge). The ``clip``, ``llava_next`` and ``llava_ov`` plugins load it
beside their tower (``pretrained_projector``); the LLaVA families' exporters write it back under
the same names.
"""
from __future__ import annotations

from typing import Dict, Optional

from omni.models.projector import PretrainedProjector

# The checkpoint layouts that hold it: transformers' save_pretrained and LLaVA-1.5 files write it
# at the top, transformers 5 holds it under model.
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# LLaVA's projector_hidden_act -> Omni's projector activation (the same function: transformers'
# "gelu" is the exact GELU, as torch's nn.GELU()).
LLAVA_ACTIVATIONS = {"gelu": "gelu", "silu": "silu", "relu": "relu"}


def llava_projector_names(prefix: str) -> Dict[str, str]:
    """The projector's tensor names -> LLaVA's (below ``prefix``)."""
    return {f"{ours}.{kind}": f"{prefix}{theirs}.{kind}" for ours, theirs in (("fc1", "linear_1"), ("fc2", "linear_2"))
            for kind in ("weight", "bias")}


def llava_pretrained_projector(path: str, model_type: str, newline: bool = False) -> Optional[PretrainedProjector]:
    """The ``multi_modal_projector`` of a LLaVA-family checkpoint (LLaVA's MLP: linear_1, the
    activation, linear_2, both as wide as the LLM, which is Omni's projector without a merge),
    and with ``newline`` its learned ``image_newline``; None when ``path`` is not a
    ``model_type`` checkpoint or lacks them (a tower of its own)."""
    from omni.models.hf_checkpoint import CheckpointReader, read_hf_config, transformers_config

    hf = read_hf_config(path)
    if hf.get("model_type") != model_type:
        return None
    config = transformers_config(hf)
    if not config.multimodal_projector_bias:
        raise ValueError(f"{path}: the LLaVA projector has no biases (multimodal_projector_bias=false), Omni's has; "
                         f"start a fresh one with projector.pretrained=false")
    act = LLAVA_ACTIVATIONS.get(config.projector_hidden_act)
    if act is None:
        raise ValueError(f"{path}: projector_hidden_act={config.projector_hidden_act!r} has no Omni projector "
                         f"activation (supported: {', '.join(LLAVA_ACTIVATIONS)})")
    reader = CheckpointReader(path)
    prefix = next((p for p in PROJECTOR_PREFIXES if p + "linear_1.weight" in reader), None)
    names = llava_projector_names(prefix) if prefix is not None else None
    if newline and names is not None:
        found = next((n for n in ("image_newline", "model.image_newline") if n in reader), None)
        names = {**names, "image_newline": found} if found is not None else None
    if names is None:
        return None
    width = int(config.text_config.hidden_size)
    return PretrainedProjector(out_dim=width, hidden=width, activation=act, names=names)
