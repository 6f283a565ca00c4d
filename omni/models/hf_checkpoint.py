"""Reading a local Hugging Face checkpoint directory: config.json and the weights
(model.safetensors, shards listed in model.safetensors.index.json, loose *.safetensors, or a
pytorch_model.bin fallback). Shared by the backbone loader and the encoder plugins."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any, Dict, Iterable, Optional

import torch


def read_hf_config(path: str) -> Dict[str, Any]:
    """config.json of a checkpoint directory, with errors that name the path and the fix."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"checkpoint directory {path!r} does not exist; pass a local directory holding config.json and "
            "the weights (download it first, e.g. `huggingface-cli download <repo> --local-dir DIR`)."
        )
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"{cfg_file!r} not found; a transformers checkpoint directory must contain config.json.")
    with open(cfg_file) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    check_transformers_knows(config, cfg_file)
    return config


def check_transformers_knows(config: Dict[str, Any], where: str) -> None:
    """Refuse, in one line naming both versions, a config.json saved by a newer transformers
    than the installed one for a model type (or its text model's) the installed one does not know:
    its classes, and so Omni's parity with them, do not exist here yet. A newer file of a known
    type goes on (transformers itself reads those)."""
    saved = config.get("transformers_version")
    if not isinstance(saved, str):
        return
    # The installed version from its metadata: transformers itself (~1 s) is imported only for
    # a newer file, to look its types up.
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    try:
        installed = metadata.version("transformers")
        if Version(saved) <= Version(installed):
            return
    except (metadata.PackageNotFoundError, InvalidVersion):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # the model's type and its language model's (a vision tower's sub-config names no class of its own)
    types = [config.get("model_type"), (config.get("text_config") or {}).get("model_type")]
    unknown = [t for t in types if isinstance(t, str) and t not in CONFIG_MAPPING_NAMES]
    if unknown:
        raise ValueError(f"{where} was saved by transformers {saved}, whose model type {unknown[0]!r} the installed "
                         f"transformers {installed} does not know; Omni is tested with the "
                         f"transformers pyproject.toml allows: use a checkpoint of a supported family "
                         f"(omni.models.families) or wait for an Omni release that supports it")


class CheckpointReader:
    """Which file holds which tensor, and reading tensors with each file opened once."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._files: Dict[str, str] = {}  # tensor name -> safetensors file
        self._bin: Optional[Dict[str, torch.Tensor]] = None
        self._handles: Dict[str, Any] = {}  # safetensors file -> open handle (header parsed once)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for name in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.path, name)):
                    raise FileNotFoundError(
                        f"shard {name!r} listed in {index!r} is missing; re-download the checkpoint."
                    )
            self._files = {k: os.path.join(self.path, v) for k, v in weight_map.items()}
            return
        loose = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if loose:
            from safetensors import safe_open

            for name in loose:
                file = os.path.join(self.path, name)
                with safe_open(file, framework="pt") as f:
                    self._files.update(dict.fromkeys(f.keys(), file))
            return
        binary = os.path.join(self.path, "pytorch_model.bin")
        if os.path.isfile(binary):
            self._bin = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
            return
        raise FileNotFoundError(
            f"no weights in {self.path!r}: expected model.safetensors, model.safetensors.index.json "
            "or pytorch_model.bin."
        )

    def keys(self) -> list[str]:
        return list(self._bin if self._bin is not None else self._files)

    def __contains__(self, key: str) -> bool:
        return key in (self._bin if self._bin is not None else self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``, read from the file header (no data)."""
        if self._bin is not None:
            return tuple(self._bin[key].shape)
        return tuple(self._open(key).get_slice(key).get_shape())

    def region(self, key: str, index: tuple) -> torch.Tensor:
        """``tensor[index]`` (one slice per dimension) reading only that region from the file,
        so a rank loads its own shard of a checkpoint, never the whole of it."""
        if self._bin is not None:
            return self._bin[key][index].clone()  # mmap-loaded: only the touched pages are read
        return self._open(key).get_slice(key)[index]

    def _open(self, key: str):
        from safetensors import safe_open

        file = self._files[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def tensors(self, keys: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
        """The named tensors (all when `keys` is None), reading each file once."""
        keys = self.keys() if keys is None else list(keys)
        if self._bin is not None:
            return {k: self._bin[k] for k in keys}
        from safetensors import safe_open

        by_file: Dict[str, list[str]] = defaultdict(list)
        for k in keys:
            by_file[self._files[k]].append(k)
        out: Dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in names})
        return out


def transformers_config(hf: Dict[str, Any]):
    """config.json contents parsed by transformers' own config class for its ``model_type``: a
    key the file leaves out gets the default transformers itself would use (llava-hf's
    LLaVA-1.5 files list only what differs from ``LlamaConfig`` and ``CLIPVisionConfig``), so
    Omni builds the model transformers builds from the same file."""
    from transformers import CONFIG_MAPPING

    kind = hf.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"config.json model_type={kind!r} is not known to the installed transformers")
    return CONFIG_MAPPING[kind].from_dict(dict(hf))
