"""`appliance bench decode | forward | prefill | kernels`: measurements printed side by side (medians,
ratios), never pass/fail. The measuring is appliance.measure.bench's; this module parses and prints."""

import dataclasses
import json
from pathlib import Path

import click

from appliance.errors import ApplianceError
from appliance.options import RunOptions

from .common import friendly, load, run_options

CONTEXT_HELP = "context depth(s) to measure at, comma separated (1K = 1024); prefilled with random ids"


@click.group()
def bench():
    """Benchmarks: decode speed, forward vs end-to-end, prefill, kernels."""


def _contexts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * scale))
    return out


def _loop(options: RunOptions, capacity: int, lm=None):
    """A request loop over a fresh decode session for `options` (loading the model unless `lm` is given)."""
    from appliance.decode.loop import RequestLoop
    from appliance.decode.session import DecodeSession

    lm = lm or load(options)
    return RequestLoop(DecodeSession(lm, options, capacity=capacity), lm.tokenizer, lm.model_dir)


def _report(rows: list[dict], cfg, bandwidth, as_json: bool, extra: dict | None = None):
    from appliance.measure.costs import step_bytes

    for r in rows:
        b = step_bytes(cfg, r["context"])
        r["bytes_per_step"] = b
        if bandwidth:
            r["copy_bandwidth_GBps"] = bandwidth / 1e9
            r["fraction_of_bandwidth"] = b["total"] / (r["forward_ms"]["median"] / 1e3) / bandwidth
    if as_json:
        click.echo(json.dumps({"runs": rows, **(extra or {})}, indent=1, default=str))
        return
    head = f"{'draft':<10}{'context':>8}{'tok/s':>9}{'ms/tok p50':>11}{'p90':>8}{'fwd ms':>9}{'cycle ms':>10}" \
           f"{'host ms':>9}{'acc/cyc':>8}{'MB/step':>9}"
    if bandwidth:
        head += f"{'of BW':>7}"
    click.echo(head)
    for r in rows:
        spec = r.get("speculative") or {}
        line = (f"{r.get('draft', 'none'):<10}{r['context']:>8}{r['tokens_per_s']:>9.1f}"
                f"{r['ms_per_token']['median']:>11.2f}{r['ms_per_token']['p90']:>8.2f}"
                f"{r['device_ms_per_cycle']:>9.2f}{r['cycle_ms']['median']:>10.2f}"
                f"{r['host_ms_per_cycle']:>9.2f}{spec.get('mean_accepted', 0.0):>8.2f}"
                f"{r['bytes_per_step']['total'] / 1e6:>9.2f}")
        if bandwidth:
            line += f"{r['fraction_of_bandwidth']:>7.1%}"
        click.echo(line)
    for k, v in (extra or {}).items():
        click.echo(f"{k}: {v}")


@bench.command("decode")
@run_options(leave_out=("context",))
@click.option("--tokens", type=int, default=64, show_default=True, help="tokens to generate per run")
@click.option("--context", "contexts", default="16", show_default=True, help=CONTEXT_HELP)
@click.option("--force-accept", type=int, default=None,
              help="every cycle accepts exactly this many drafts (cycle cost independent of the weights)")
@click.option("--compare-transformers", is_flag=True,
              help="also run transformers' generate() on the same checkpoint (transformers format, plain "
                   "numerics) and check the tokens are identical")
@click.option("--ep-ranks", type=int, default=4, show_default=True,
              help="expert-parallel ranks for the balancedness of the verify step's routing")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_decode(options: RunOptions, tokens, contexts, force_accept, compare_transformers, ep_ranks, as_json):
    """Greedy decode speed: tokens/s, ms per token (median, p90), the model's forward time per cycle beside
    the end-to-end cycle time (the gap is host overhead), bytes read per step, and on a GPU the fraction
    of the measured copy bandwidth. With --draft, --draft none is measured in the same run beside it."""
    from appliance.measure import bench as mb

    ctx = _contexts(contexts)
    capacity = max(ctx) + tokens + 64
    lm = load(options)
    drafts = ["none"] if options.draft == "none" else ["none", options.draft]
    loops = {d: _loop(dataclasses.replace(options, draft=d), capacity, lm) for d in drafts}
    bandwidth = mb.copy_bandwidth(lm.runtime.device)
    rows = []
    for c in ctx:
        for d, loop in loops.items():
            r = mb.measure_decode(loop, c, tokens, force_accept if d != "none" else None)
            r["draft"] = d if force_accept is None or d == "none" else f"{d}@{force_accept}"
            rows.append(r)
    extra = {}
    session = loops["none"].session
    if lm.cfg.n_routed_experts % ep_ranks == 0:
        sequence = mb.random_prompt(lm.cfg.vocab_size, 256, seed=1)
        extra["expert_parallel_balancedness"] = mb.measure_balancedness(session, sequence, options.draft_tokens + 1,
                                                                        ep_ranks)
    if compare_transformers:
        extra["transformers"] = mb.transformers_decode(loops["none"], lm.model_dir, ctx[0], tokens)
    _report(rows, lm.cfg, bandwidth, as_json, extra)


@bench.command("forward")
@run_options(decode=False)
@click.option("--context", "contexts", default="16", show_default=True, help=CONTEXT_HELP)
@click.option("--width", type=int, default=1, show_default=True, help="rows per forward (a verify block: k+1)")
@click.option("--repeats", type=int, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_forward(options: RunOptions, contexts, width, repeats, as_json):
    """The model's own time for one decode cycle of `width` rows at each context depth (CUDA events on a
    GPU, wall time of the eager step on CPU), with bytes per step and the fraction of copy bandwidth."""
    from appliance.measure import bench as mb

    ctx = _contexts(contexts)
    session = _loop(dataclasses.replace(options, graphs=False), max(ctx) + repeats * width + 8).session
    bandwidth = mb.copy_bandwidth(session.device)
    rows = []
    for c in ctx:
        row = mb.measure_forward(session, c, width, repeats)
        if bandwidth:
            row["fraction_of_bandwidth"] = row["bytes_per_step"]["total"] / (row["forward_ms"]["median"] / 1e3) \
                / bandwidth
        rows.append(row)
    if as_json:
        click.echo(json.dumps({"runs": rows, "copy_bandwidth": bandwidth}, indent=1))
        return
    bw_head = "  of BW" if bandwidth else ""
    click.echo(f"{'context':>8}{'width':>6}{'fwd ms p50':>11}{'p90':>8}{'MB/step':>9}" + bw_head)
    for r in rows:
        line = (f"{r['context']:>8}{r['width']:>6}{r['forward_ms']['median']:>11.2f}{r['forward_ms']['p90']:>8.2f}"
                f"{r['bytes_per_step']['total'] / 1e6:>9.2f}")
        if bandwidth:
            line += f"{r['fraction_of_bandwidth']:>7.1%}"
        click.echo(line)


@bench.command("prefill")
@run_options(leave_out=("draft", "draft_tokens", "context", "no_graphs"))
@click.option("--tokens", type=int, default=1024, show_default=True, help="prompt length")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_prefill(options: RunOptions, tokens, as_json):
    """Prefill throughput: a prompt of random ids processed in chunks of --chunk."""
    from appliance.measure import bench as mb

    row = mb.measure_prefill(_loop(dataclasses.replace(options, graphs=False), tokens + 8).session, tokens)
    if as_json:
        click.echo(json.dumps(row))
    else:
        click.echo(f"prefill {tokens} tokens in chunks of {row['chunk']}: {row['ms']:.1f} ms, "
                   f"{row['tokens_per_s']:.1f} tokens/s")


@bench.command("collectives")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None, envvar="APPLIANCE_MODEL",
              help="the payloads are this model's: a row of its hidden size (per layer), times 1..7 rows")
@click.option("--devices", default="cpu:4", show_default=True, envvar="APPLIANCE_DEVICES",
              help="the ranks to measure between: 0,1,2,3 (GPUs) or cpu:4 (gloo)")
@click.option("--repeats", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_collectives(model_dir, devices, repeats, as_json):
    """Latency of the fixed-order sum over ranks at the decode cycle's payloads (one row of the hidden size
    per layer for a plain step, up to 7 rows for a verify), for each way of gathering the partials that
    works here: nccl (gloo on CPU) and, on GPUs that reach each other, symm."""
    import torch

    from appliance.loader import default_model_dir
    from appliance.measure import bench as mb
    from appliance.model.config import load_config
    from appliance.parallel.collectives import make_sum, peers_reachable
    from appliance.parallel.world import start

    world = start(devices)
    if not world.distributed:
        raise ApplianceError(f"--devices {devices}: a collective needs several ranks (cpu:4, 0,1,2,3)",
                             field="devices")
    dim = load_config(model_dir or default_model_dir()).dim
    device = torch.device(world.device)
    modes = ["nccl"] + (["symm"] if device.type == "cuda" and peers_reachable(world.size) else [])
    sums = {m: make_sum(m, world.size, world.rank, device, capacity=8 * dim) for m in modes}
    rows = mb.measure_collectives(sums, [dim * r for r in (1, 2, 4, 7)], device, repeats)
    if world.main:
        if as_json:
            click.echo(json.dumps({"ranks": world.size, "device": str(device),
                                   "backend": torch.distributed.get_backend(), "runs": rows}, indent=1))
        else:
            backend = torch.distributed.get_backend()
            click.echo(f"{world.size} ranks on {device} ({backend}): fixed-order fp32 sum over ranks")
            click.echo(f"{'allreduce':<10}{'values':>9}{'KB':>8}{'us p50':>10}{'p90':>10}")
            for r in rows:
                click.echo(f"{r['allreduce']:<10}{r['values']:>9}{r['bytes'] / 1e3:>8.1f}{r['us']['median']:>10.1f}"
                           f"{r['us']['p90']:>10.1f}")
    world.stop()


@bench.command("kernels")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@click.option("--iters", type=int, default=50, show_default=True, help="timed calls per op (median)")
@click.option("--tiny", is_flag=True, help="toy shapes (without CUDA: under the Triton interpreter)")
def bench_kernels(as_json, iters, tiny):
    """Each kernel at V4.1 decode shapes, M = 1 and 6: time, bytes moved, GB/s, fraction of copy bandwidth."""
    from kernels import bench as kb

    notes = []
    results = kb.run(iters=iters, tiny=tiny, notice=notes.append if as_json else click.echo)
    if as_json:
        click.echo(json.dumps({"notes": notes, "measured": bool(results), "results": kb.as_json(results)}, indent=1))
    elif results:
        click.echo(kb.table(results))
    else:
        click.echo("(run with --tiny to exercise the harness at toy shapes under the interpreter)")
