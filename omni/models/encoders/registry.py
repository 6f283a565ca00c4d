"""Finding encoder plugins by name.

Three ways, tried in order:

1. built-ins (``siglip``, ``whisper``, ``qwen_vl``, ``qwen3_vl``, ``qwen_omni_vision``, ``qwen_omni_audio``, ``qwen3_omni_vision``, ``qwen3_omni_audio``, ``clip``, ``siglip2``, ``llava_ov``, ``llava_next``): always available, also when omni is not pip-installed;
2. installed packages that declare an entry point in the ``omni.encoders`` group, e.g. in their
   pyproject.toml::

       [project.entry-points."omni.encoders"]
       my_vit = "my_pkg.vit:MyViTEncoder"

3. a dotted class path, ``pkg.mod:Class`` or ``pkg.mod.Class`` (Hydra ``_target_`` style).

Built-ins win over an entry point of the same name from another package.

What a class path may name (config is data, not code): a *class* in a module importable from the
Python path, written as dot-separated Python identifiers with at most one ``:`` between the module
and the class (``pkg.mod:Outer.Inner`` is fine). Refused with a one-line ValueError before anything
is imported: file paths (``/tmp/x.py:Cls``, ``../evil``), relative imports, parts that are not
identifiers, are keywords or start with ``__`` (``Cls.__class__``). Refused after the import and
before anything is called: an object that is not a class (``os.system``, a module, a function or a
factory). The class must then pass the plugin check (an ``EncoderAnchor`` subclass, or a class with
its methods). Importing a module runs its top-level code, as any import does: name only packages
you trust.
"""
from __future__ import annotations

import importlib
import keyword
import warnings
from importlib import metadata
from typing import Any, Dict, List, Mapping, Optional

from omni.models.encoders.base import EncoderAnchor

ENTRY_POINT_GROUP = "omni.encoders"
BUILTIN_ORIGIN = "omni (built-in)"
_BUILTINS: Dict[str, str] = {
    "siglip": "omni.models.encoders.siglip:SiglipEncoder",
    "whisper": "omni.models.encoders.whisper:WhisperEncoder",
    "qwen_vl": "omni.models.encoders.qwen_vl:QwenVisionEncoder",
    "qwen3_vl": "omni.models.encoders.qwen3_vl:Qwen3VisionEncoder",
    "qwen_omni_vision": "omni.models.encoders.qwen_omni_vision:QwenOmniVisionEncoder",
    "qwen_omni_audio": "omni.models.encoders.qwen_omni_audio:QwenOmniAudioEncoder",
    "qwen3_omni_vision": "omni.models.encoders.qwen3_omni_vision:Qwen3OmniVisionEncoder",
    "qwen3_omni_audio": "omni.models.encoders.qwen3_omni_audio:Qwen3OmniAudioEncoder",
    "clip": "omni.models.encoders.clip:ClipEncoder",
    "siglip2": "omni.models.encoders.siglip2:Siglip2Encoder",
    "llava_ov": "omni.models.encoders.llava_ov:LlavaOvEncoder",
    "llava_next": "omni.models.encoders.llava_next:LlavaNextEncoder",
}
_REQUIRED = ("modality", "Config", "build_config", "processor", "forward", "cost_coefficients", "from_pretrained")


def _entry_points() -> Dict[str, List[metadata.EntryPoint]]:
    """Plugin entry points by name (excluding omni's own declarations of its built-ins)."""
    found: Dict[str, List[metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if _BUILTINS.get(ep.name) == ep.value.replace(" ", ""):
            continue  # omni itself, pip-installed
        if ep.name in _BUILTINS:
            warnings.warn(
                f"{_origin(ep)} declares encoder '{ep.name}', which is a built-in name; the built-in is used "
                "(give the plugin a different name or use its dotted class path)",
                stacklevel=3,
            )
            continue
        if not any(e.value == ep.value for e in found.get(ep.name, [])):
            found.setdefault(ep.name, []).append(ep)
    return found


def _origin(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return f"entry point {ENTRY_POINT_GROUP} ({ep.value})"
    return f"entry point {ENTRY_POINT_GROUP} from package {dist.metadata['Name']} {dist.version}"


def available_encoders() -> Dict[str, str]:
    """name -> where it comes from."""
    out = {name: BUILTIN_ORIGIN for name in _BUILTINS}
    for name, eps in sorted(_entry_points().items()):
        out[name] = "; ".join(_origin(ep) for ep in eps)
    return out


def _check(cls: Any, what: str) -> type:
    if isinstance(cls, type) and issubclass(cls, EncoderAnchor):
        return cls
    missing = [a for a in _REQUIRED if not hasattr(cls, a)]
    if not isinstance(cls, type) or missing:
        detail = f"missing {', '.join(missing)}" if missing else "not a class"
        raise ValueError(f"{what} is not an encoder plugin ({detail}); subclass omni.models.encoders.EncoderAnchor")
    return cls


_FORM = "expected 'pkg.mod:Class' or 'pkg.mod.Class' naming a class importable from the Python path"


def _split_dotted(path: str) -> tuple[str, str]:
    """(module, attribute path) of a class path, or a ValueError naming it (no import is done)."""
    if not isinstance(path, str):
        raise ValueError(f"encoder class path {path!r} is not a string; {_FORM}")
    if "/" in path or "\\" in path or path.endswith((".py", ".pyc", ".so")) or ".py:" in path:
        raise ValueError(f"encoder class path {path!r} looks like a file path, which is never loaded; {_FORM} "
                         f"(install the package or put its folder on PYTHONPATH)")
    if path.count(":") > 1:
        raise ValueError(f"bad encoder class path {path!r} (more than one ':'); {_FORM}")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    parts = [*module_name.split("."), *attr.split(".")]
    bad = [p for p in parts if not p.isidentifier() or keyword.iskeyword(p) or p.startswith("__")]
    if not module_name or not attr or bad:
        why = (f" (part {bad[0]!r}: each part must be a Python identifier, not a keyword, not starting with '__')"
               if bad and bad[0] else "")
        raise ValueError(f"bad encoder class path {path!r}{why}; {_FORM}")
    return module_name, attr


def _import_dotted(path: str) -> type:
    """The class a dotted class path names; anything that is not a class is refused (never called)."""
    module_name, attr = _split_dotted(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import encoder class {path!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"cannot import encoder class {path!r}: {module_name} has no {attr!r}") from None
    if not isinstance(obj, type):
        raise ValueError(f"encoder class path {path!r} names a {type(obj).__name__}, not a class; {_FORM} "
                         f"(an EncoderAnchor subclass)")
    return obj


def get_encoder_class(name: str) -> type:
    """Encoder class for a registered name or a dotted class path."""
    if name in _BUILTINS:
        return _check(_import_dotted(_BUILTINS[name]), f"built-in encoder '{name}'")
    eps = _entry_points()
    if name in eps:
        if len(eps[name]) > 1:
            where = ", ".join(_origin(ep) for ep in eps[name])
            raise ValueError(
                f"encoder '{name}' is declared by several packages ({where}); "
                "uninstall one or give a dotted class path"
            )
        ep = eps[name][0]
        try:
            cls = ep.load()
        except Exception as e:  # a broken plugin: say which one
            raise ValueError(f"cannot load encoder '{name}' ({_origin(ep)}, {ep.value}): {e}") from e
        return _check(cls, f"encoder '{name}' ({ep.value})")
    if any(c in name for c in ".:/\\"):
        return _check(_import_dotted(name), repr(name))
    names = ", ".join([*_BUILTINS, *sorted(eps)])
    raise ValueError(
        f"unknown encoder '{name}'; registered encoders: {names} (install a plugin package that declares "
        f"an `{ENTRY_POINT_GROUP}` entry point, or give a dotted class path)"
    )


def build_encoder(name: str, params: Optional[Mapping[str, Any]] = None, pretrained: Optional[str] = None) -> EncoderAnchor:
    """Build an encoder: random init from ``params``, or load ``pretrained`` (a transformers
    checkpoint dir) with ``params`` as overrides of its config."""
    cls = get_encoder_class(name)
    if pretrained:
        return cls.from_pretrained(pretrained, **dict(params or {}))
    return cls(cls.build_config(params))
