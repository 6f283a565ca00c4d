"""Declarative data mixture: a YAML file listing sources with weights.

    sources:
      - {name: shapes, path: shapes, weight: 0.4}   # path relative to this file's folder
      - {name: text, path: /data/text, weight: 0.6}
    eval: eval                                       # optional held-out folder

Every mistake is reported as ``FILE:LINE: key: problem; fix`` using the YAML node marks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from dataloading.errors import DataError

SOURCE_KEYS = ("name", "path", "weight")
TOP_KEYS = ("sources", "eval")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: Path  # absolute
    weight: float


@dataclass
class Mixture:
    sources: list[SourceSpec]
    file: Path | None = None
    eval: Path | None = None

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.sources}


def _value(node: yaml.Node):
    # Build plain Python values from a node so each value keeps its own line number.
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _mapping(node: yaml.Node) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    return {str(k.value): (k, v) for k, v in node.value}


def load_mixture(path: str | Path) -> Mixture:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"mixture file {path}: not found; pass the path of a mixture YAML (see docs/data.md)",
                        kind="config")

    def err(node: yaml.Node, what: str) -> DataError:
        return DataError(f"{path}:{node.start_mark.line + 1}: {what}", kind="config")

    try:
        root = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f"{path}:{line + 1}" if line is not None else str(path)
        raise DataError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})", kind="config") from None
    if not isinstance(root, yaml.MappingNode):
        line = f":{root.start_mark.line + 1}" if root is not None else ""
        raise DataError(f"{path}{line}: expected a mapping with a 'sources' list", kind="config")
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
            raise err(item, f"{where} must be a mapping with keys {list(SOURCE_KEYS)}")
        fields = _mapping(item)
        for key, (knode, _) in fields.items():
            if key not in SOURCE_KEYS:
                raise err(knode, f"{where}: unknown key {key!r}; expected {list(SOURCE_KEYS)}")
        for key in SOURCE_KEYS:
            if key not in fields:
                raise err(item, f"{where}: missing key {key!r}")
        (_, nnode), (_, pnode), (_, wnode) = (fields[k] for k in SOURCE_KEYS)
        name, rel, weight = _value(nnode), _value(pnode), _value(wnode)
        if not isinstance(name, str) or not name or "/" in name:
            raise err(nnode, f"{where}.name must be a non-empty string without '/', got {name!r}")
        if name in names:
            raise err(nnode, f"{where}.name {name!r} repeats sources[{names[name]}].name; names must be unique")
        names[name] = i
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight < 0:
            raise err(wnode, f"{where}.weight must be a number >= 0, got {weight!r}")
        if not isinstance(rel, str) or not rel:
            raise err(pnode, f"{where}.path must be a string, got {rel!r}")
        folder = (path.parent / rel).expanduser().resolve()
        if not folder.is_dir():
            raise err(pnode, f"{where}.path: folder {folder} does not exist; fix the path (relative paths "
                             f"start at {path.parent})")
        sources.append(SourceSpec(name, folder, float(weight)))
    if sum(s.weight for s in sources) <= 0:
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
