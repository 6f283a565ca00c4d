"""Declarative data mixture: a YAML file listing sources with weights.

    sources:
      - {name: shapes, path: shapes, weight: 0.4}   # path relative to this file's folder
      - name: text
        path: /data/text/shard-{000..099}.tar       # folder, glob, brace list or URL
        weight: {0: 0.6, 5000: 0.2}                 # piecewise-linear curriculum over steps
        over_budget: split                          # per-source options, see OPTION_KEYS
    eval: eval                                       # optional held-out folder

Every mistake is reported as ``FILE:LINE: key: problem; fix`` using the YAML node marks.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from dataloading.errors import DataError
from dataloading.formats.chat import ASSISTANT_LOSS
from dataloading.formats.modality import MODALITIES, Registry

REQUIRED_KEYS = ("name", "path", "weight")
TOP_KEYS = ("sources", "eval")
OVER_BUDGET_POLICIES = ("error", "truncate", "split", "skip")
BUCKETS = ("auto", "short", "long")


def option_keys(modalities: Registry = MODALITIES) -> tuple[str, ...]:
    """A source's optional keys: one per media kind (its preprocessing options, each kind's
    ``Modality.options``: the encoder's processor applies them, a video's the image processor
    that encodes videos; see docs/data.md) among the others."""
    return ("max_media", *modalities.names, "chat_template", "assistant_loss", "bucket", "over_budget")


OPTION_KEYS = option_keys()


@dataclass(frozen=True)
class WeightSchedule:
    """A source's weight over training steps: a constant, or piecewise-linear between points.

    Before the first point the first weight holds, after the last the last one.
    """

    points: tuple[tuple[int, float], ...]

    def at(self, step: int) -> float:
        steps = [p[0] for p in self.points]
        return float(np.interp(step, steps, [p[1] for p in self.points]))

    @classmethod
    def constant(cls, w: float) -> "WeightSchedule":
        return cls(((0, float(w)),))


@dataclass(frozen=True)
class SourceOptions:
    max_media: int | None = None  # samples with more media items are skipped (counted)
    media: dict = field(default_factory=dict)  # modality -> processor options
    chat_template: str | None = None  # "...{prompt}..." wraps the prompt text (txt samples)
    assistant_loss: str = "all"  # conversations: loss on "all" assistant turns or the "last"
    bucket: str = "auto"  # encoder long-short bucket for this source's media
    over_budget: str | None = None  # None: data.over_budget


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: Path | str  # a folder (absolute Path), or the spec of a glob / brace list / URL
    weight: float | WeightSchedule
    options: SourceOptions = field(default_factory=SourceOptions)

    def weight_at(self, step: int) -> float:
        return self.weight.at(step) if isinstance(self.weight, WeightSchedule) else float(self.weight)


@dataclass
class Mixture:
    sources: list[SourceSpec]
    file: Path | None = None
    eval: Path | None = None

    @property
    def weights(self) -> dict[str, float]:
        """The weights at step 0 (see ``weights_at`` for curricula)."""
        return self.weights_at(0)

    def weights_at(self, step: int) -> dict[str, float]:
        return {s.name: s.weight_at(step) for s in self.sources}

    @property
    def has_schedule(self) -> bool:
        return any(isinstance(s.weight, WeightSchedule) for s in self.sources)


def _value(node: yaml.Node):
    # Build plain Python values from a node so each value keeps its own line number.
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _mapping(node: yaml.Node) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    return {str(k.value): (k, v) for k, v in node.value}


def _records_format(head: str) -> str | None:
    """The ``omni data convert --from`` that reads ``text`` when it is a dataset's records, not a
    mixture: a JSON list of objects (LLaVA's layout) or JSON lines. A mixture is a YAML mapping;
    its JSON spelling (``{"sources": ...}``) is one object, and YAML writes keys unquoted.
    ``head``: the file's first characters (a dataset may be gigabytes)."""
    if re.match(r'\s*\[\s*\{\s*"', head):
        return "llava"
    lines = [line for line in head.splitlines() if line.strip()][:2]
    try:
        objects = [json.loads(line) for line in lines]
    except ValueError:
        return None
    if len(objects) == 2 and all(isinstance(o, dict) and "sources" not in o for o in objects):
        return "jsonl"
    return None


def load_mixture(path: str | Path, modalities: Registry = MODALITIES) -> Mixture:
    """The mixture file at ``path``; ``modalities``: the media kinds whose options a source may set."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"mixture file {path}: not found; pass the path of a mixture YAML (see docs/data.md)",
                        kind="config")

    def err(node: yaml.Node, what: str) -> DataError:
        return DataError(f"{path}:{node.start_mark.line + 1}: {what}", kind="config")

    with path.open() as f:
        fmt = _records_format(f.read(1 << 16))
    if fmt is not None:  # said before YAML parses a dataset of a million records
        raise DataError(f"{path} holds a dataset's records (conversations), not a mixture file; convert it first: "
                        f"`omni data convert --from {fmt} {path} --media-root DIR --out OUT` (DIR: where its media "
                        "paths start), then pass a mixture file that names OUT as a source "
                        "(sources: [{name: mine, path: OUT, weight: 1}]) as data.mixture; see docs/data.md",
                        kind="config")
    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f"{path}:{line + 1}" if line is not None else str(path)
        raise DataError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})", kind="config") from None
    if not isinstance(root, yaml.MappingNode):
        line = f":{root.start_mark.line + 1}" if root is not None else ""
        raise DataError(f"{path}{line}: expected a mapping with a 'sources' list (sources: [{{name, path, weight}}, "
                        "...]); a dataset's records are converted first with `omni data convert`, see docs/data.md",
                        kind="config")
    top = _mapping(root)
    for key, (knode, _) in top.items():
        if key not in TOP_KEYS:
            raise err(knode, f"unknown key {key!r}; expected one of {list(TOP_KEYS)}")
    if "sources" not in top:
        raise err(root, "missing key 'sources' (a list of {name, path, weight})")
    snode = top["sources"][1]
    if not isinstance(snode, yaml.SequenceNode) or not snode.value:
        raise err(snode, "'sources' must be a non-empty list of {name, path, weight}")

    sources: list[SourceSpec] = []
    names: dict[str, int] = {}
    for i, item in enumerate(snode.value):
        where = f"sources[{i}]"
        if not isinstance(item, yaml.MappingNode):
            raise err(item, f"{where} must be a mapping with keys {list(REQUIRED_KEYS)}")
        fields = _mapping(item)
        source_keys = REQUIRED_KEYS + option_keys(modalities)
        for key, (knode, _) in fields.items():
            if key not in source_keys:
                raise err(knode, f"{where}: unknown key {key!r}; expected {list(source_keys)}")
        for key in REQUIRED_KEYS:
            if key not in fields:
                raise err(item, f"{where}: missing key {key!r}")
        (_, nnode), (_, pnode), (_, wnode) = (fields[k] for k in REQUIRED_KEYS)
        name, rel = _value(nnode), _value(pnode)
        if not isinstance(name, str) or not name or "/" in name or "#" in name:
            raise err(nnode, f"{where}.name must be a non-empty string without '/' or '#', got {name!r}")
        if name in names:
            raise err(nnode, f"{where}.name {name!r} repeats sources[{names[name]}].name; names must be unique")
        names[name] = i
        weight = _weight(wnode, f"{where}.weight", err)
        if not isinstance(rel, str) or not rel:
            raise err(pnode, f"{where}.path must be a string, got {rel!r}")
        source_path = _source_path(rel, path.parent, lambda what: err(pnode, f"{where}.path: {what}"))
        options = _options(fields, where, err, modalities)
        sources.append(SourceSpec(name, source_path, weight, options))
    if sum(_peak(s.weight) for s in sources) <= 0:
        raise err(snode, "all source weights are 0; give at least one source a positive weight")

    eval_dir = None
    if "eval" in top:
        enode = top["eval"][1]
        rel = _value(enode)
        if rel is not None:
            eval_dir = (path.parent / str(rel)).expanduser().resolve()
            if not eval_dir.is_dir():
                raise err(enode, f"eval: folder {eval_dir} does not exist; fix the path or remove the key")
    return Mixture(sources, path.resolve(), eval_dir)


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _peak(weight: float | WeightSchedule) -> float:
    return max(w for _, w in weight.points) if isinstance(weight, WeightSchedule) else weight


def _weight(node: yaml.Node, where: str, err) -> float | WeightSchedule:
    """A number >= 0, or a mapping {step: weight} (a piecewise-linear schedule)."""
    if isinstance(node, yaml.MappingNode):
        points = []
        for knode, vnode in node.value:
            step, w = _value(knode), _value(vnode)
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise err(knode, f"{where}: schedule steps must be integers >= 0, got {step!r}")
            if not _number(w) or w < 0:
                raise err(vnode, f"{where}: the weight at step {step} must be a number >= 0, got {w!r}")
            points.append((step, float(w)))
        if not points:
            raise err(node, f"{where}: an empty schedule; write a number or {{step: weight, ...}}")
        steps = [p[0] for p in points]
        if steps != sorted(set(steps)):
            raise err(node, f"{where}: schedule steps must be increasing, got {steps}")
        return WeightSchedule(tuple(points))
    weight = _value(node)
    if not _number(weight) or weight < 0:
        raise err(node, f"{where} must be a number >= 0 or a schedule {{step: weight, ...}}, got {weight!r}")
    return float(weight)


def _source_path(rel: str, base: Path, fail) -> Path | str:
    """A folder stays a Path (the common case); globs, brace lists and URLs are checked by
    ``dataloading.index.sources`` and kept as written."""
    if "://" in rel or any(c in rel for c in "*?[{"):
        from dataloading.index.sources import resolve_source

        try:
            resolve_source(rel, base)
        except DataError as e:
            raise fail(str(e)) from None
        return rel if "://" in rel else str(base / Path(rel).expanduser()) if not Path(rel).is_absolute() else rel
    folder = (base / rel).expanduser().resolve()
    if not folder.is_dir():
        raise fail(f"folder {folder} does not exist; fix the path (relative paths start at {base})")
    return folder


def _options(fields: dict, where: str, err, modalities: Registry) -> SourceOptions:
    opts: dict = {}
    if "max_media" in fields:
        knode, vnode = fields["max_media"]
        v = _value(vnode)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise err(vnode, f"{where}.max_media must be an integer >= 0, got {v!r}")
        opts["max_media"] = v
    media = {}
    for modality, allowed in ((m.name, m.options) for m in modalities):
        if modality not in fields:
            continue
        _, mnode = fields[modality]
        if not isinstance(mnode, yaml.MappingNode):
            raise err(mnode, f"{where}.{modality} must be a mapping with keys {list(allowed)}")
        values = {}
        for key, (knode, vnode) in _mapping(mnode).items():
            if key not in allowed:
                raise err(knode, f"{where}.{modality}: unknown key {key!r}; expected {list(allowed)}")
            v, kind = _value(vnode), allowed[key]
            if isinstance(kind, tuple):
                if v not in kind:
                    raise err(vnode, f"{where}.{modality}.{key} must be one of {list(kind)}, got {v!r}")
            elif not _number(v) or v <= 0 or (kind is int and not isinstance(v, int)):
                raise err(vnode, f"{where}.{modality}.{key} must be a positive {kind.__name__}, got {v!r}")
            values[key] = v
        media[modality] = values
    opts["media"] = media
    if "chat_template" in fields:
        _, vnode = fields["chat_template"]
        v = _value(vnode)
        if not isinstance(v, str) or v.count("{prompt}") != 1:
            raise err(vnode, f"{where}.chat_template must be a string with exactly one '{{prompt}}', got {v!r}")
        opts["chat_template"] = v
    for key, allowed in (("bucket", BUCKETS), ("over_budget", OVER_BUDGET_POLICIES),
                         ("assistant_loss", ASSISTANT_LOSS)):
        if key in fields:
            _, vnode = fields[key]
            v = _value(vnode)
            if v not in allowed:
                raise err(vnode, f"{where}.{key} must be one of {list(allowed)}, got {v!r}")
            opts[key] = v
    return SourceOptions(**opts)
