"""Plain-text tables of simulation results (``omni simulate`` and ``omni plan`` print them)."""
from __future__ import annotations

from typing import Any

from omni.sim.workload import workload_lines


def describe_layout(layout: dict[str, Any]) -> str:
    parts = [f"{k}{layout[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
             if layout.get(k, 1) > 1 or k == "dp_shard"]
    text = " x ".join(parts)
    if layout.get("pp", 1) > 1:
        v = layout.get("pp_virtual_stages", 1)
        text += f" ({layout.get('pp_schedule')}{f', {v} chunks/rank' if v > 1 else ''})"
    return text


def placement_table(result: dict[str, Any]) -> str:
    model, cluster = result["model"], result["cluster"]
    enc = ", ".join(f"{m} {e['params_b']:.2f}B" for m, e in model["encoders"].items()) or "no encoders"
    lines = [f"{result.get('name', 'simulate')}: LLM {model['llm_params_b']:.1f}B + {enc} on {cluster['num_gpus']} x "
             f"{cluster['name']} ({cluster['gpus_per_node']}/node); layout {describe_layout(result['layout'])}, "
             f"{result['layout']['micro_batches']} micro-batches per DP rank",
             *(workload_lines(result["workload"]) if "workload" in result else []),
             "(simulated: roofline op times with the cluster's efficiency factors; see docs/simulate.md)", ""]
    places = result["placements"]
    # Speed-ups over Megatron-LM's own layout when it is simulated (the baseline the paper
    # compares against), else over stage0.
    base_name = "megatron" if "megatron" in places else "stage0"
    base = places[base_name]["step_time_s"] if base_name in places else 0.0
    head = (f"{'placement':<18}{'step s':>9}{'vs ' + base_name:>12}{'tokens/s':>11}{'MFU':>7}{'bubble':>8}{'comm':>7}"
            f"{'busy min/max s':>16}{'mem GiB':>9}{'fits':>6}")
    lines += [head, "-" * len(head)]
    for name, p in places.items():
        # "-" where the baseline was not simulated (sim.placements without it)
        ratio = f"{base / p['step_time_s']:.2f}x" if p["step_time_s"] > 0 and base else "-"
        busy = p["busy_s"]
        lines.append(f"{name:<18}{p['step_time_s']:>9.3f}{ratio:>12}{p['tokens_per_s']:>11.0f}{100 * p['mfu']:>6.1f}%"
                     f"{100 * p['bubble_fraction']:>7.1f}%{100 * p['comm_share']:>6.1f}%{busy['min']:>8.2f}/{busy['max']:<7.2f}"
                     f"{p['memory_gib']['total']:>9.1f}{'yes' if p['fits'] else 'NO':>6}")
    worst = [(n, p) for n, p in places.items() if not p["fits"]]
    for name, p in worst:
        m = p["memory_gib"]
        lines.append(f"  {name}: out of memory: {m['total']:.1f} GiB > {p['memory_limit_gib']:.1f} GiB usable "
                     f"(params {m['params']:.1f}, grads {m['grads']:.1f}, optimizer {m['optimizer']:.1f}, gathered "
                     f"{m['gathered']:.1f}, activations {m['activations']:.1f}, transient {m['transient']:.1f}) on "
                     f"{p['ranks_over_memory']} GPU group(s)")
    mbs = result["layout"].get("micro_batches")
    for name in ("megatron", "megatron_naive"):
        if name in places and places[name]["layout"]["micro_batches"] != mbs:
            lines.append(f"  {name}: {places[name]['layout']['micro_batches']} micro-batches per DP rank "
                         f"({places[name]['layout']['packing']} packing)")
    for name, p in places.items():
        if "chunks_per_cut_search" in p:
            tried = ", ".join(f"{g} {r['step_time_s']:.3f} s{'' if r['fits'] else ' (OOM)'}"
                              for g, r in p["chunks_per_cut_search"].items())
            lines.append(f"  {name}: multiplex.chunks_per_cut={p['layout']['chunks_per_cut']} chosen for the run "
                         f"(sim.chunks_per_cut_search; tried {tried})")
        if "fill_bubbles_search" in p:
            tried = ", ".join(f"{k} {r['step_time_s']:.3f} s{'' if r['fits'] else ' (OOM)'}"
                              for k, r in p["fill_bubbles_search"].items())
            lines.append(f"  {name}: multiplex.fill_bubbles={p['layout']['fill_bubbles']} chosen for the run "
                         f"(tried {tried}; {p['bubble_items']:.0f} items per step in bubble calls)")
        elif p.get("bubble_items"):
            lines.append(f"  {name}: {p['bubble_items']:.0f} items per step encoded in the pipeline's bubbles "
                         f"(multiplex.fill_bubbles)")
    if "disaggregated" in places:
        lines.append(f"  disaggregated: {places['disaggregated']['layout']['encoder_gpus']} GPUs run only the "
                     f"encoders; the LLM runs {describe_layout(places['disaggregated']['layout'])}")
    return "\n".join(lines)


def plan_table(result: dict[str, Any], name: str) -> str:
    cl = result["cluster"]
    lines = [f"{name}: {result['searched']} layouts searched, {result['simulated']} simulated on {cl['num_gpus']} x "
             f"{cl['name']} ({result['placement']} placement; simulated, see docs/simulate.md)",
             *(workload_lines(result["workload"]) if "workload" in result else []), ""]
    head = f"{'#':<3}{'layout':<58}{'sp':>3}{'cut':>4}{'ckpt':>10}{'tokens':>8}{'step s':>9}{'tokens/s':>11}{'MFU':>7}{'mem GiB':>9}"
    lines += [head, "-" * len(head)]
    for i, r in enumerate(result["ranked"], 1):
        lay = r["layout"]
        lines.append(f"{i:<3}{describe_layout(lay):<58}{lay['encoder_sp']:>3}{lay['chunks_per_cut']:>4}"
                     f"{lay['activation_checkpoint']:>10}"
                     f"{lay['micro_batch_tokens']:>8}{r['step_time_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
                     f"{100 * r['mfu']:>6.1f}%{r['memory_gib']:>9.2f}")
    if result["ranked"]:
        lines += ["", "best, as omni train overrides:", "  " + " ".join(result["ranked"][0]["overrides"])]
    lines += ["", "why the others lost:"]
    for reason, n in sorted(result["rejected_counts"].items(), key=lambda x: -x[1]):
        example = next(r for r in result["rejected"] if r["reason"] == reason)
        detail = example.get("detail") or (f"e.g. {describe_layout(example['layout'])}: "
                                           f"{example['result']['tokens_per_s']:.0f} tokens/s")
        lines.append(f"  {n:>5} {reason}: {detail}")
    return "\n".join(lines)
