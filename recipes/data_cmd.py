"""`omni data demo`, `omni data index` and `omni data convert`."""
from __future__ import annotations

from pathlib import Path


def demo_main(out: str, seed: int = 0, scale: float = 1.0) -> int:
    from dataloading.demo import write_demo_dataset

    path = write_demo_dataset(Path(out), seed=seed, scale=scale, progress=True)
    print(f"omni: demo dataset written to {path}; mixture file {Path(path) / 'mixture.yaml'}")
    return 0


def index_main(spec: str, workers: int | None = None) -> int:
    from dataloading.index.source_index import build_index

    # A string, not a Path: Path would turn "s3://b/x" into "s3:/b/x".
    index = build_index(spec, workers=workers, progress=True)
    print(f"omni: {index.summary()}")
    return 0


def convert_main(fmt: str, input_spec: str, out: str, media_root: str | None = None, **options) -> int:
    """``options``: dataloading.convert.run.convert's (dry_run, workers, shard_size, split)."""
    from dataloading.convert.run import convert

    summary = convert(fmt, input_spec, out, media_root, progress=True, **options)
    for line in summary.lines():
        print(f"omni: {line}")
    return 0
