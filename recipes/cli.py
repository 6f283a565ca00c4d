"""The ``omni`` command line: ``omni train``, ``omni data demo|index``, ``omni plugins``."""
from __future__ import annotations

import argparse
import os
import sys

TRAIN_EPILOG = """\
overrides (Hydra syntax):
  GROUP=OPTION          choose a preset, e.g. model=tiny_moe, encoders=vision_only
  GROUP.KEY=VALUE       change one knob, e.g. trainer.max_steps=50 optim.lr=1e-3
  experiment=NAME       a whole experiment preset (default: demo)

config groups and their options:
{groups}

examples:
  omni train                                  # the CPU demo
  omni train experiment=demo_moe trainer.max_steps=200
  omni train data.mixture=/data/mix.yaml model=hf model.pretrained=/ckpt/llama
  omni train --cfg job                        # print the composed config and exit
  torchrun --standalone --nproc-per-node 2 --no-python omni train
"""


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from recipes.compose import group_options

    groups = "\n".join(f"  {g:<11} {', '.join(opts)}" for g, opts in group_options().items())
    p = sub.add_parser(
        "train",
        help="train a multimodal model (Hydra overrides follow)",
        description="Train a multimodal LLM. Every knob is a Hydra override; see docs/configuration.md.",
        epilog=TRAIN_EPILOG.format(groups=groups),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.max_steps=50")


def _data_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="dataset tools: demo, index")
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="{demo,index}")
    demo = dsub.add_parser("demo", help="write the demo dataset (shards, index, mixture.yaml)")
    demo.add_argument("--out", required=True, help="output folder")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--scale", type=float, default=1.0, help="dataset size multiplier")
    idx = dsub.add_parser("index", help="build the per-sample metadata index of a folder of shards")
    idx.add_argument("folder", help="folder holding webdataset .tar shards (searched recursively)")
    idx.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni",
        description="Omni: train multimodal LLMs under dynamic workloads.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{train,data,plugins}")
    _train_parser(sub)
    _data_parsers(sub)
    sub.add_parser("plugins", help="list registered plugins (encoders) and where they come from")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "train":
        from recipes.train import train_main

        return train_main(args.overrides, print_cfg=args.cfg == "job")
    if args.cmd == "data":
        from recipes.data_cmd import demo_main, index_main

        if args.data_cmd == "demo":
            return demo_main(args.out, seed=args.seed, scale=args.scale)
        return index_main(args.folder, workers=args.workers)
    if args.cmd == "plugins":
        from recipes.plugins_cmd import plugins_main

        return plugins_main()
    raise AssertionError(args.cmd)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from recipes.errors import USER_ERRORS, one_line

    try:
        return _run(args)
    except USER_ERRORS as exc:
        if os.environ.get("OMNI_TRACEBACK"):
            raise
        print(f"omni: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omni: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
