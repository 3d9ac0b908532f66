"""`appliance info`: what a model is and weighs, from its config alone, and one rank's memory plan."""

import json

import click

from appliance.errors import ApplianceError
from appliance.options import RunOptions

from .common import friendly, model_option


@click.command()
@model_option()
@click.option("--devices", "n_devices", type=int, default=None,
              help="plan memory per rank for the model split over this many GPUs")
@click.option("--gpu-memory", default=None, help="memory of one GPU for the plan, e.g. 288GB (B300), 141GB (H200)")
@click.option("--context", type=int, default=None, help="context length for the plan (default: the model's maximum)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="the run's activation dtype, in which the decode state is stored (as --dtype of a run)")
@click.option("--no-drafter", is_flag=True, help="plan without the drafter (a run with --draft none)")
@click.option("--chunk", type=int, default=RunOptions.chunk, show_default=True,
              help="the prefill chunk (serve's --chunk): the plan holds the scratch of a prompt's last chunk")
@click.option("--json", "as_json", is_flag=True, help="print JSON (with `fits` and the per-rank table)")
@friendly
def info(model_dir, n_devices, gpu_memory, context, dtype, no_drafter, chunk, as_json):
    """Architecture summary, layer roles, weight bytes by dtype and by where they live, and decode-state
    bytes per token of context. With --devices and --gpu-memory, the memory plan of one rank: what the fast
    path holds (built from the config on the meta device and warmed up by one forward: weights in their
    stored format, float copies and kernel caches, the decode states as stored), graph buffers, the scratch
    of a prompt's last prefill chunk (as counted on that build), headroom. Needs only config.json (weights
    are not read)."""
    from appliance.loader import default_model_dir
    from appliance.measure import sizes as inf
    from appliance.measure.memory import fast_path_plan, parse_bytes
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config, summary

    cfg = load_config(model_dir or default_model_dir())
    mm = meta_model(cfg, dtype)  # the whole checkpoint, drafter included
    report = {"config": summary(cfg), "layers": inf.layer_roles(cfg), "weights": inf.weight_bytes(mm),
              "state": inf.state_bytes(mm)}
    if (n_devices is None) != (gpu_memory is None):
        raise ApplianceError("give --devices and --gpu-memory together for a memory plan", field="devices")
    if n_devices is not None:
        if n_devices < 1:
            raise ApplianceError(f"--devices {n_devices}: must be at least 1", field="devices")
        try:
            capacity = parse_bytes(gpu_memory)
        except ValueError:
            raise ApplianceError(f"--gpu-memory {gpu_memory}: not a size like 288GB", field="gpu_memory") from None
        ctx = context or cfg.max_context
        if chunk < 1:
            raise ApplianceError(f"--chunk {chunk}: must be at least 1", field="chunk")
        plan = fast_path_plan(cfg, ctx, capacity, world=n_devices, dtype=dtype, drafter=not no_drafter, chunk=chunk)
        report["plan"] = {"devices": n_devices, "gpu_memory": capacity, "context": ctx, "dtype": dtype, "chunk": chunk,
                          "drafter": not no_drafter, "fits": plan.fits, "per_rank": plan.parts,
                          "total_per_rank": plan.total, "free_per_rank": capacity - plan.total, **plan.details,
                          "weights_per_rank": inf.rank_weights(meta_model(cfg, dtype, drafter=not no_drafter,
                                                                            world=n_devices))}
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print_info(cfg, report, inf.human)


def _print_info(cfg, report, human):
    c = cfg
    click.echo(f"{c.family}: {c.n_layers} layers, hidden {c.dim}, {c.n_heads} heads x {c.head_dim} "
               f"(RoPE {c.rope_head_dim}), q-LoRA {c.q_lora_rank}, {c.o_groups} output groups x {c.o_lora_rank}")
    click.echo(f"  experts: {c.n_routed_experts} routed (top-{c.n_activated_experts}) + {c.n_shared_experts} shared, "
               f"intermediate {c.moe_inter_dim}; mHC x{c.hc_mult}; window {c.window_size}; "
               f"indexer {c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}; vocab {c.vocab_size}")
    if c.dspark:
        d = c.dspark
        click.echo(f"  drafter: DSpark, {d.n_stages} stages, block {d.block_size}, targets {list(d.target_layer_ids)}, "
                   f"{d.n_routed_experts} experts top-{d.n_activated_experts}")
    elif c.family == "deepseek_v4" and c.n_mtp_layers:
        click.echo("  drafter: MTP head (1 layer)")
    click.echo("layers:")
    for row in report["layers"]:
        extra = " ".join(k for k in ("engram", "dspark_input", "hash_moe") if row.get(k))
        src = f" kv<-{row['kv_from']} topk<-{row['topk_from']}" if row.get("kv_from") is not None else ""
        click.echo(f"  {row['layer']:>3}  ratio {row['ratio']:>3}  {row['mode']:<26}{src} {extra}".rstrip())
    w = report["weights"]
    click.echo(f"weights: {human(w['total'])} in {w['tensors']} tensors")
    for k, v in sorted(w["by_dtype"].items(), key=lambda kv: -kv[1]):
        click.echo(f"  {k:<8} {human(v)}")
    click.echo("  by part: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_part"].items()))
    click.echo("  where: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_where"].items()))
    s = report["state"]
    click.echo(f"decode state per token of context: {s['per_token_packed']:.1f} B packed "
               f"({s['per_token_held']:.1f} B as held in {s['dtype']}); constant {human(s['constant_packed'])} packed "
               f"({human(s['constant_held'])} held)")
    plan = report.get("plan")
    if plan:
        click.echo(f"memory plan per rank: {plan['devices']} x {human(plan['gpu_memory'])}, context {plan['context']}, "
                   f"prefill chunk {plan['chunk']}: {'fits' if plan['fits'] else 'DOES NOT FIT'}")
        for part, n in plan["per_rank"].items():
            click.echo(f"  {part:<24} {human(n):>10}")
        click.echo(f"  {'total':<24} {human(plan['total_per_rank']):>10}   free {human(plan['free_per_rank'])}")
        click.echo(f"  decode state as stored ({plan['dtype']}): {plan['state_bytes_per_token']:.1f} B per token "
                   f"+ {human(plan['state_constant'])}")
        click.echo("  largest copies: " + ", ".join(f"{k} {human(v)}" for k, v in plan["largest_copies"].items()))
        w = plan["weights_per_rank"]
        click.echo("  weights by dtype: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_dtype"].items()))
        click.echo("  weights by part: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_part"].items()))
        click.echo(f"  host (memory-mapped once per box): Engram tables {human(w['host_engram_tables'])}")
