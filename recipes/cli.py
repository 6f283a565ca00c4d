"""The ``omni`` command line: ``omni train``, ``omni data demo|index|convert|plan|calibrate``, ``omni simulate``,
``omni plan``, ``omni export``, ``omni generate``, ``omni plugins``."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

TRAIN_EPILOG = """\
overrides (Hydra syntax):
  GROUP=OPTION          choose a preset, e.g. model=tiny_moe, encoders=vision_only,
                        encoders/vision=siglip (one encoder slot's preset)
  GROUP.KEY=VALUE       change one knob, e.g. trainer.max_steps=50 optim.lr=1e-3
  experiment=NAME       a whole experiment preset (default: demo)
  name=NAME             the run's name; runs write to runs/<name> (trainer.run_dir). Default: the
                        preset's name, or <model>-<digest> once the model, encoders or data differ

config groups and their options:
{groups}

examples:
  omni train                                  # the CPU demo
  omni train experiment=demo_moe trainer.max_steps=200
  omni train data.mixture=/data/mix.yaml model=hf model.pretrained=/ckpt/llama
  omni train --cfg job                        # print the composed config and exit
  .venv/bin/torchrun --standalone --nproc-per-node 2 --no-python .venv/bin/omni train
                                              # 2 ranks (with the venv of the README's install)
"""


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from recipes.compose import group_options

    groups = "\n".join(f"  {g:<16} {', '.join(opts)}" for g, opts in group_options().items())
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
    p = sub.add_parser("data", help="dataset tools: demo, index, convert, plan, calibrate")
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="{demo,index,convert,plan,calibrate}")
    demo = dsub.add_parser("demo", help="write the demo dataset (shards, index, mixture.yaml)")
    demo.add_argument("--out", required=True, help="output folder")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--scale", type=float, default=1.0, help="dataset size multiplier")
    idx = dsub.add_parser(
        "index", help="build the per-sample metadata index of a source of shards",
        description="Build the per-sample metadata index of a source (see docs/data.md, 'Sources').",
        epilog="examples:\n  omni data index data/shapes\n  omni data index 'data/**/train-*.tar'\n"
               "  omni data index 'data/x/shard-{000000..000009}.tar'\n"
               "  omni data index 's3://bucket/x/shard-{000000..000099}.tar'   # needs: pip install fsspec s3fs\n"
               "quote globs and brace lists, or the shell expands them first",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    idx.add_argument("folder", metavar="SPEC",
                     help="a folder of webdataset .tar shards (searched recursively), a glob, a brace list or a URL "
                          "(s3://, gs://, https://, file://, any fsspec protocol); quote globs and braces")
    idx.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    _convert_parser(dsub)


    plan = dsub.add_parser(
        "plan", help="dry run: what each DP rank gets per step (balance, utilisation, mixture shares)",
        description="Plan steps of the data plane without training: reads only the metadata index. Takes the "
                    "same Hydra overrides as `omni train` (data.mixture=..., data.micro_batch_tokens=..., model=...).",
        epilog="examples:\n  omni data plan --dp 16 --steps 5\n  omni data plan data.mixture=mix.yaml --dp 64 "
               "--balance none\n  omni data plan --dp 8 --steps 3 --json | jq .ranks[0].cost",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.mixture=/data/mix.yaml")
    plan.add_argument("--dp", type=int, default=8, help="data-parallel ranks to plan for (default 8)")
    plan.add_argument("--steps", type=int, default=10, help="steps to plan (default 10)")
    plan.add_argument("--balance", default=None,
                      help="arrangement: balanced, lpt, kk, sorted_greedy, packed, none (default: data.balance)")
    plan.add_argument("--json", action="store_true", help="one JSON object per step (step, ranks: cost, tokens, samples)")
    plan.add_argument("--save-state", metavar="FILE", help="write the planner state after the last step")
    plan.add_argument("--load-state", metavar="FILE",
                      help="start from a state written by --save-state (or a checkpoint's trainer_state.pt)")
    cal = dsub.add_parser(
        "calibrate", help="fit the cost model (alpha, beta per LLM and encoder) to measured micro-batch times",
        description="Time forward+backward of the configured model on micro-batches of the configured data and "
                    "fit cost = sum(alpha*L^2 + beta*L) + sum over media (alpha_e*n^2 + beta_e*n) by least squares. "
                    "Use the result with data.cost_file=FILE.")
    cal.add_argument("overrides", nargs="*", help="Hydra overrides, as for `omni train`")
    cal.add_argument("--micro-batches", type=int, default=48, help="micro-batches to time (default 48)")
    cal.add_argument("--repeats", type=int, default=3, help="timings per micro-batch; the median is used")
    cal.add_argument("--out", default="cost.yaml", help="where to write the fitted cost model (default cost.yaml)")


CONVERT_EPILOG = """\
formats (--from):
  llava       LLaVA JSON or JSONL: {id, image, conversations: [{from: human|gpt, value}]}
  sharegpt    ShareGPT JSON or JSONL: {conversations|messages: [{from|role, value|content}], images, videos, system}
  jsonl       Omni / OpenAI-style JSON or JSONL: {id, messages: [{role, content}], images, videos, audios}
  parquet     parquet file, folder or quoted glob with the jsonl columns (media as paths or {bytes, path})
  hf-dataset  a folder written by datasets' save_to_disk (a DatasetDict: --split, default train)

examples:
  omni data convert --from llava llava_v1_5_mix665k.json --media-root data/llava --out data/llava-conv
  omni data convert --from sharegpt chats.jsonl --media-root media --out data/chats --dry-run
  omni data convert --from parquet 'hf/train-*.parquet' --out data/hf-train --workers 16
"""


def _convert_parser(dsub: argparse._SubParsersAction) -> None:
    from dataloading.convert.records import FORMATS
    from dataloading.convert.run import DEFAULT_SHARD_SIZE

    p = dsub.add_parser(
        "convert", help="convert a LLaVA / ShareGPT / JSONL / parquet / datasets conversation dataset into an "
                        "indexed source of shards",
        description="Convert conversations with media into Omni's shards (messages.json + numbered media), index "
                    "them, and list every record that could not be converted in OUT/convert_report.jsonl "
                    "(docs/data.md, 'Converting datasets').",
        epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Not argparse choices: an unknown format is one `omni: error:` line like every input problem.
    p.add_argument("--from", dest="fmt", required=True, metavar="FORMAT", help=f"one of {', '.join(FORMATS)}")
    p.add_argument("input", metavar="INPUT", help="a JSON / JSONL file, parquet files (file, folder, glob) or a "
                                                  "saved datasets folder")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--media-root", default=None,
                   help="the folder relative media paths start from (default: INPUT's folder)")
    p.add_argument("--dry-run", action="store_true", help="check every record and its media, print the counts, "
                                                          "write nothing")
    p.add_argument("--workers", type=int, default=None, help="processes (default: CPU count)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                   help=f"input records per shard (default {DEFAULT_SHARD_SIZE})")
    p.add_argument("--split", default=None, help="--from hf-dataset: the DatasetDict's split (default train)")


SIM_EPILOG = """\
overrides: as for `omni train` (model=, encoders/vision=, parallel.*, multiplex.*), plus
  workload=A|B|C|D     MegaScale-Omni's workloads (model, cluster, layout, batch)
  cluster=h100|h200|h800|a100|l20   cluster.num_gpus=N   cluster.gemm_efficiency=...
  data.image_ratio=0.9 data.global_batch_size=... data.source=mixture data.mixture=mix.yaml
  sim.placements=[colocated,stage0]   sim.calibration=fit.yaml   sim.encoder_gpus=N

examples:
  omni simulate workload=C data.image_ratio=0.9
  omni simulate workload=D parallel.pp=16 --json | jq .placements.colocated.mfu
  omni simulate --calibrate run/trace_step3.json --out fit.yaml <the run's overrides>
  omni plan workload=B cluster=h200
"""


def _sim_parser(sub: argparse._SubParsersAction, name: str, example: str, json_holds: str,
                **texts: str) -> argparse.ArgumentParser:
    """``omni simulate`` or ``omni plan``: both take Hydra overrides (``example``) and ``--json``
    (one JSON object of ``json_holds``), and share the epilog; ``texts``: help, description."""
    p = sub.add_parser(name, epilog=SIM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, **texts)
    p.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {example}")
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({json_holds})")
    return p


def _sim_parsers(sub: argparse._SubParsersAction) -> None:
    sim = _sim_parser(
        sub, "simulate", "workload=C data.image_ratio=0.9", "placements -> figures",
        help="predict step time, MFU, bubbles and memory per placement on a (large) cluster",
        description="Simulate training steps of a model on a cluster without running them: the real schedule "
                    "and planners, per-op times from FLOPs and bytes (docs/simulate.md).")
    sim.add_argument("--calibrate", metavar="TRACE",
                     help="fit the cluster's efficiency factors to a measured Chrome trace of `omni train` "
                          "(multiplex.trace_step=N) run with the same overrides")
    sim.add_argument("--out", metavar="FILE", help="with --calibrate: write the fitted factors here "
                                                    "(use them with sim.calibration=FILE)")
    sim.add_argument("--plot", metavar="FILE.png", help="draw the step decomposition per placement (PNG)")
    plan = _sim_parser(
        sub, "plan", "workload=B cluster=h200", "ranked layouts, rejections",
        help="search layouts for a model, cluster and mixture; print the best (and why others lost)",
        description="Search dp_replicate, dp_shard, tp, pp, virtual stages, cp, ep, micro-batch tokens, encoder SP, "
                    "long threshold and activation checkpointing under the memory limit; rank by simulated "
                    "throughput (docs/simulate.md).")
    plan.add_argument("--top", type=int, default=None, help="layouts to show (default sim.top_k)")
    plan.add_argument("--placement", default="colocated", help="placement to plan for (default colocated)")
    plan.add_argument("--plot", metavar="FILE.png", help="draw the ranked layouts' steps and tokens/s (PNG)")


EXPORT_EPILOG = """\
MODEL is one of:
  a run directory          runs/NAME: its newest completed checkpoint (or --step N)
  a checkpoint folder      runs/NAME/checkpoints/step_00000100 (saved under any layout)
  a Hugging Face directory a supported family (omni.models.families), e.g. to change its dtype

the model is written in its family's own transformers class: Qwen2-VL / Qwen2.5-VL for a qwen_vl
vision tower with its patch merger, the LLM's own class (LlamaForCausalLM, ...) for an LLM alone;
the tokenizer is the one the run trained with (chat template included). A run trained with LoRA
(model.lora) is written with its adapters merged into the weights; --adapter writes them apart.

examples:
  omni export runs/qwen-ft --out exported/qwen-ft
  omni export runs/qwen-ft --step 200 --dtype bf16 --out exported/qwen-ft-200
  omni export runs/qwen-lora --adapter --out exported/qwen-lora   (base + peft adapter in OUT/adapter)
"""


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory (model, tokenizer, processor)",
        description="Write a trained model in its Hugging Face class, loadable by transformers "
                    "(AutoModelForImageTextToText / AutoModelForCausalLM) and by `omni train model.pretrained=`.",
        epilog=EXPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="a run directory, a checkpoint folder or a Hugging Face directory")
    p.add_argument("--out", required=True, help="the folder to write (new or empty, unless --force)")
    p.add_argument("--step", type=int, default=None, help="the run's checkpoint of this step (default: the newest)")
    p.add_argument("--dtype", default=None, help="cast the weights: bf16, fp16 or fp32 (default: as trained)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write the model without its adapters merged, and the adapters as a peft "
                        "adapter folder in OUT/adapter (default: merged into the weights)")


GENERATE_EPILOG = """\
MODEL: a Hugging Face directory of a supported family, a run directory (its newest checkpoint,
or --step N) or a checkpoint folder. The prompt is one user turn, the media first, rendered with
the tokenizer's chat template (generation prompt added).

examples:
  omni generate --model /ckpt/Qwen2.5-VL-7B-Instruct --image cat.jpg --prompt "What is this?"
  omni generate --model runs/demo --image shapes.png --prompt "Describe the image." --greedy
  omni generate --model runs/qwen-ft --image a.png --prompt "Caption it." --temperature 0.7 --top-p 0.9 --json
"""


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text for a prompt and its media (KV cache; greedy or sampled)",
        description="Generate an answer to one prompt with images / audio, from a trained run or a Hugging "
                    "Face directory.", epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face directory, a run directory or a checkpoint folder")
    p.add_argument("--prompt", required=True, help="the user's text")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image (repeat for more)")
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="a video (mp4, webm)")
    p.add_argument("--audio", action="append", default=[], metavar="FILE", help="an audio file (wav, flac)")
    p.add_argument("--video-audio", action="store_true",
                   help="also take each video's own audio track, interleaved with its frames (the Omni thinkers)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--greedy", action="store_true", help="the most likely token each step (the default)")
    p.add_argument("--temperature", type=float, default=None, help="sample with this temperature")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of this probability")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint of this step (default: the newest)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids (generated only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni",
        description="Omni: train multimodal LLMs under dynamic workloads.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{train,data,simulate,plan,export,generate,plugins}")
    _train_parser(sub)
    _data_parsers(sub)
    _sim_parsers(sub)
    _export_parser(sub)
    _generate_parser(sub)
    sub.add_parser("plugins", help="list registered plugins (encoders) and where they come from")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "train":
        from recipes.train import train_main

        return train_main(args.overrides, print_cfg=args.cfg == "job")
    if args.cmd == "data":
        from recipes.data_cmd import convert_main, demo_main, index_main

        if args.data_cmd == "demo":
            return demo_main(args.out, seed=args.seed, scale=args.scale)
        if args.data_cmd == "convert":
            return convert_main(args.fmt, args.input, args.out, media_root=args.media_root, dry_run=args.dry_run,
                                workers=args.workers, shard_size=args.shard_size, split=args.split)
        if args.data_cmd == "plan":
            from recipes.plan_cmd import plan_main

            return plan_main(args.overrides, dp=args.dp, steps=args.steps, balance=args.balance, as_json=args.json,
                             save_state=args.save_state, load_state=args.load_state)
        if args.data_cmd == "calibrate":
            from recipes.calibrate_cmd import calibrate_main

            return calibrate_main(args.overrides, micro_batches=args.micro_batches, repeats=args.repeats,
                                  out=args.out)
        return index_main(args.folder, workers=args.workers)
    if args.cmd == "simulate":
        from recipes.simulate_cmd import simulate_main

        return simulate_main(args.overrides, as_json=args.json, calibrate=args.calibrate, out_file=args.out,
                             plot=args.plot)
    if args.cmd == "plan":
        from recipes.simulate_cmd import plan_main

        return plan_main(args.overrides, as_json=args.json, top=args.top, placement=args.placement, plot=args.plot)
    if args.cmd == "export":
        from recipes.export_cmd import export_main

        return export_main(args.model, args.out, step=args.step, dtype=args.dtype, force=args.force,
                           adapter=args.adapter)
    if args.cmd == "generate":
        from recipes.generate_cmd import generate_main

        return generate_main(args.model, args.prompt, images=args.image, videos=args.video, audios=args.audio,
                             video_audio=args.video_audio,
                             max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, seed=args.seed, as_json=args.json, step=args.step,
                             device=args.device)
    if args.cmd == "plugins":
        from recipes.plugins_cmd import plugins_main

        return plugins_main()
    raise AssertionError(args.cmd)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    from omni.runtime.stop import RunStopped
    from recipes.errors import USER_ERRORS, last_line, one_line

    try:
        return _run(args)
    except USER_ERRORS as exc:
        if os.environ.get("OMNI_TRACEBACK"):
            raise
        last_line(f"omni: error: {one_line(exc)}")
        return 2
    except RunStopped as exc:  # Ctrl-C or SIGTERM during training: where it stopped, how to go on
        last_line(f"omni: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:  # outside training's loop: nothing to save
        last_line("omni: interrupted")
        return 130


def entry(argv: list[str] | None = None) -> NoReturn:
    """The ``omni`` command: `main`, then the process's exit."""
    code = main(argv)
    if code == 2 and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # torchrun ends the other workers as soon as one exits. A rank whose user error is already
        # in its error file leaves at once instead of tearing the interpreter down (a second or
        # more on a busy machine): else a peer that exits first has torchrun SIGTERM this rank,
        # and the report's root cause (the earliest error file) shows -15, not the rank's own 2.
        # Nothing ran yet that a teardown would finish.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
