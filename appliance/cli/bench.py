"""`appliance bench decode | forward | prefill | kernels`: measurements printed side by side (medians,
ratios), never pass/fail. The measuring is appliance.measure.bench's; this module parses and prints."""

import dataclasses
import json
from pathlib import Path

import click

from appliance.errors import ApplianceError
from appliance.options import EXPERTS, RunOptions

from .common import check_range, friendly, load, model_option, run_options

# costmodel.GPUS's names, spelled here so that --help needs no torch (tests/test_cli.py holds them equal)
GPU_KINDS = ("b300", "b200", "h200", "h100")
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
    from appliance.measure.shapes import meta_model
    from appliance.measure.sizes import step_bytes

    mm = meta_model(cfg)
    for r in rows:
        b = step_bytes(mm, r["context"])
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
@click.option("--routing-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the experts every MoE call selected (plain steps and verify blocks of a 256-token "
                   "prompt) as JSON lines: `bench model --routing` prices the busiest rank by them")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_decode(options: RunOptions, tokens, contexts, force_accept, compare_transformers, ep_ranks, routing_out,
                 as_json):
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
    if routing_out is not None:
        sequence = mb.random_prompt(lm.cfg.vocab_size, 256, seed=1)
        calls = [c for w in sorted({1, options.draft_tokens + 1}) for c in mb.routed_calls(session, sequence, w)]
        routing_out.write_text("".join(json.dumps(c) + "\n" for c in calls))
        extra["routing_out"] = f"{len(calls)} MoE calls in {routing_out}"
    if compare_transformers:
        extra["transformers"] = mb.transformers_decode(loops["none"], lm.model_dir, ctx[0], tokens)
    _report(rows, lm.cfg, bandwidth, as_json, extra)


@bench.command("forward")
@run_options(leave_out=("context",))
@click.option("--context", "contexts", default="16", show_default=True, help=CONTEXT_HELP)
@click.option("--width", type=int, default=1, show_default=True,
              help="rows the cycle's target forward takes: 1 = a plain step; W > 1 = a draft + verify cycle of "
                   "W - 1 drafts (the checkpoint's drafter, or --draft)")
@click.option("--repeats", type=int, default=20, show_default=True)
@click.option("--no-count", is_flag=True, help="time only: leave out the launch, sync and byte counts")
@click.option("--memory", is_flag=True, help="also compare what the load allocated with the memory plan (per rank)")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_forward(options: RunOptions, contexts, width, repeats, no_count, memory, as_json):
    """The device time of one decode cycle at each context depth (CUDA events around the graph replay on a
    GPU, the wall time of the eager steps on CPU) and what the cycle does, counted on any machine:
    launches per cycle and per layer, host syncs, collectives, bytes the kernels read against the ideal,
    operations a CUDA-graph capture refuses; on a GPU the fraction of the copy bandwidth. With several
    devices (cpu:4, 0,1,2,3), every rank's counts."""
    from appliance.decode.session import DecodeSession
    from appliance.measure import bench as mb
    from appliance.measure.count import count_cycle

    check_range("--width", width, 1, 6)
    if width > 1:
        options = dataclasses.replace(options, draft="auto" if options.draft == "none" else options.draft,
                                      draft_tokens=width - 1)
    else:
        options = dataclasses.replace(options, draft="none")
    before = mb.allocated_now(options.devices) if memory else None
    lm = load(options)
    world = lm.world
    held = mb.allocated_now(options.devices, before) if memory else None
    bandwidth = mb.copy_bandwidth(lm.runtime.device)
    rows = []
    for c in _contexts(contexts):
        capacity = c + width + 16
        session = DecodeSession(lm, options, capacity=capacity, reach_floor=capacity)
        if width > 1 and session.spec is None:
            raise ApplianceError(f"--width {width}: a verify of several rows needs a drafter; this checkpoint has "
                                 "none (mtp.* tensors)", field="width")
        row = mb.measure_cycle(session, c, repeats)
        if not no_count:
            row.update(count_cycle(session, world=world.size if world else 1))
            row.pop("launches")  # each launch's reads: the cost model's input, not this table's
            row["capture_blockers"] = blockers(lm.capture_blockers, row.pop("capture_violations"))
            if bandwidth:
                row["fraction_of_bandwidth"] = row["bytes_per_step"]["total"] / (row["forward_ms"]["median"] / 1e3) \
                    / bandwidth
        rows.append(row)
    extra = {"copy_bandwidth": bandwidth, "launch_us": mb.measure_launch_latency(lm.runtime.device)}
    if memory:
        extra["memory"] = mb.memory_against_plan(lm, options, held, world.size if world else 1)
    ranks = gather_ranks(world, [rows, extra.get("memory")])
    if ranks is not None:
        for i, row in enumerate(rows):
            row["ranks"] = [rank_summary(r, part[0][i]) for r, part in enumerate(ranks)]
        if memory:
            extra["memory_per_rank"] = [part[1] for part in ranks]
    if as_json:
        click.echo(json.dumps({"runs": rows, **extra}, indent=1, default=str))
        return
    _forward_table(rows, bandwidth, counted=not no_count)
    if extra["launch_us"]:
        click.echo(f"one launch inside a CUDA graph: {extra['launch_us']:.2f} us")
    for m in extra.get("memory_per_rank") or ([extra["memory"]] if memory else []):
        click.echo(f"memory after load: {m['allocated'] / 1e6:.1f} MB allocated, plan {m['plan'] / 1e6:.1f} MB "
                   f"(weights + copies + caches), {m['ratio']:.3f}x")


def blockers(load_time: list[str], violations: list[dict]) -> list[str]:
    """What stops a capture: the load's findings, then each operation a capture refuses, once, with where."""
    seen = list(load_time)
    for v in violations:
        line = f"{v['why']} at {v['where'][-1] if v['where'] else '?'}"
        if line not in seen:
            seen.append(line)
    return seen


def gather_ranks(world, rows: list[dict]) -> list | None:
    """Every rank's rows on every rank (None with one rank)."""
    if world is None or not world.distributed:
        return None
    import torch.distributed as dist

    parts: list = [None] * world.size
    dist.all_gather_object(parts, rows)
    return parts


def rank_summary(rank: int, row: dict) -> dict:
    keys = ("launches_per_cycle", "launches_per_layer", "host_syncs_per_cycle", "float64_launches_per_cycle",
            "collectives", "host_link", "capture_blockers")
    b = row.get("bytes_per_step", {})
    return {"rank": rank, **{k: row.get(k) for k in keys},
            "bytes_per_step": {k: b.get(k) for k in ("total", "ideal", "ratio")}}


def _forward_table(rows: list[dict], bandwidth, counted: bool):
    head = f"{'context':>8}{'width':>6}{'fwd ms p50':>11}{'p90':>8}"
    if counted:
        head += f"{'launch/cyc':>11}{'/layer':>7}{'syncs':>6}{'coll':>5}{'MB read':>9}{'ideal':>9}{'ratio':>6}"
    if bandwidth:
        head += f"{'of BW':>7}"
    click.echo(head)
    for r in rows:
        line = f"{r['context']:>8}{r['width']:>6}{r['forward_ms']['median']:>11.2f}{r['forward_ms']['p90']:>8.2f}"
        if counted:
            b = r["bytes_per_step"]
            line += (f"{r['launches_per_cycle']:>11}{r['launches_per_layer']:>7}{r['host_syncs_per_cycle']:>6}"
                     f"{r['collectives']['per_cycle']:>5}{b['total'] / 1e6:>9.2f}{b['ideal'] / 1e6:>9.2f}"
                     f"{b['ratio']:>6.2f}")
        if bandwidth:
            line += f"{r['fraction_of_bandwidth']:>7.1%}"
        click.echo(line)
        for rank in r.get("ranks", []):
            click.echo(f"    rank {rank['rank']}: {rank['launches_per_cycle']} launches ({rank['launches_per_layer']} "
                       f"per layer), {rank['host_syncs_per_cycle']} host syncs, {rank['collectives']['per_cycle']} "
                       f"collectives, {rank['bytes_per_step']['total'] / 1e6:.2f} MB read "
                       f"({rank['bytes_per_step']['ratio']:.2f}x ideal)")
        for line in r.get("capture_blockers", []):
            click.echo(f"    capture blocker: {line}")


@bench.command("model")
@model_option()
@click.option("--devices", "n_devices", type=int, default=4, show_default=True,
              help="GPUs the model is split over (one rank each)")
@click.option("--gpu", type=click.Choice(GPU_KINDS), default="b300", show_default=True)
@click.option("--draft-tokens", "k", type=int, default=0, show_default=True,
              help="drafts per cycle (0: the plain cycle only; otherwise it is modeled beside the plain one)")
@click.option("--accepted", type=float, default=None,
              help="mean accepted drafts per cycle (a cycle makes A + 1 tokens); needed with --draft-tokens")
@click.option("--context", type=int, default=32768, show_default=True, help="positions before the cycle")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True,
              help="activation dtype (the decode state is stored in it)")
@click.option("--routing", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="measured routing (JSON lines, one MoE call's rows' expert ids each; `bench decode "
                   "--routing-out` writes them): the busiest rank's expert reads from it instead of uniform routing")
@click.option("--experts", type=click.Choice(EXPERTS), default="auto", show_default=True,
              help="the experts' placement the cycle is counted with (see `serve --help`)")
@click.option("--top", type=int, default=8, show_default=True, help="kernels listed per cycle, the slowest first")
@click.option("--allreduce", type=click.Choice(["symm", "nccl"]), default="symm", show_default=True,
              help="how the sums over ranks meet (see `serve --help`): symm, symmetric memory (the box's auto: its "
                   "GPUs reach each other over NVLink), each published by the kernel that makes it and waited for "
                   "inside the kernel that uses it; nccl, an "
                   "all-gather")
@click.option("--prefill", is_flag=True,
              help="price a prompt's prefill instead: one chunk counted at the start and one at the end of the "
                   "longest prompt (--context, at least 855000), the time to first token of 32K, 128K, 855K "
                   "and --context token prompts")
@click.option("--chunk", type=int, default=RunOptions.chunk, show_default=True,
              help="with --prefill: the prefill chunk (serve's --chunk)")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_model(model_dir, n_devices, gpu, k, accepted, context, dtype, routing, experts, top, allreduce, prefill,
                chunk, as_json):
    """A cost model of one decode cycle on N GPUs of a kind: the cycle's launches, bytes and collectives
    counted on the fast path built from config.json alone (meta device, no weights read), each launch priced
    at what bounds it (its bytes, the instructions its weight products issue, their tensor FLOPs, the host
    link) with the hardware constants it prints, plus the busiest rank's extra expert reads, the launches'
    fixed cost and the collectives; the cycle time, each kernel's bound, and the tokens/s against the best
    public results. With --prefill, the same for a prompt's prefill chunks and its time to first token.
    Assumptions: appliance/measure/costmodel.py."""
    from appliance.decode.session import DecodeSession
    from appliance.loader import default_model_dir
    from appliance.measure import costmodel as cm
    from appliance.measure.count import count_cycle
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config

    check_range("--devices", n_devices, 1)
    check_range("--context", context, 1)
    check_range("--draft-tokens", k, 0, 5)
    if k and accepted is None:
        raise ApplianceError("--draft-tokens needs --accepted A (mean accepted drafts per cycle, 0..k)",
                             field="accepted")
    if k:
        check_range("--accepted", accepted, 0, k)
    cfg = load_config(model_dir or default_model_dir())
    if k and cfg.dspark is None and not cfg.n_mtp_layers:
        raise ApplianceError("--draft-tokens: this model has no drafter (mtp.* in its config)", field="draft_tokens")
    calls = _routing(routing, cfg.n_routed_experts) if routing is not None else None
    device = cm.GPUS[gpu]
    if prefill:
        _prefill_model(cfg, model_dir, n_devices, device, context, chunk, dtype, experts, allreduce, top, as_json)
        return
    mm = meta_model(cfg, dtype, drafter=bool(k), world=n_devices, experts=experts, allreduce=allreduce)
    report = {"model": str(model_dir or default_model_dir()), "devices": n_devices, "context": context,
              "allreduce": allreduce,
              "routing": f"{len(calls)} measured calls from {routing}" if calls else "uniform (simulated)",
              "constants": cm.constants(device), "anchors": cm.ANCHORS, "cycles": []}
    for draft, tokens in (("none", 1.0), ("auto", (accepted or 0) + 1.0))[: 2 if k else 1]:
        options = RunOptions(draft=draft, draft_tokens=max(k, 1), path="fast", dtype=dtype)
        capacity = context + k + 16
        session = DecodeSession(mm, options, capacity=capacity, reach_floor=capacity)
        count = count_cycle(session, context, world=n_devices)
        count.pop("torch_ops")
        count["capture_violations"] = len(count["capture_violations"])
        prediction = cm.predict(count, device, n_devices, tokens, calls)
        placement = cm.placement(count, device, n_devices, cfg.dim, calls)
        count.pop("launches")  # priced one by one in the prediction's kernel table
        report["cycles"].append({"draft_tokens": k if draft != "none" else 0, "count": count,
                                 "prediction": prediction, "against_anchors": cm.against_anchors(prediction),
                                 "placement": placement})
    if as_json:
        click.echo(json.dumps(report, indent=1, default=str))
        return
    _model_table(report, device, top)


def _routing(path: Path, experts: int) -> list:
    from appliance.measure import costmodel as cm

    try:
        calls = cm.load_routing(path, experts)
    except ValueError as e:
        raise ApplianceError(f"--routing {path}: {e}", field="routing") from None
    if not calls:
        raise ApplianceError(f"--routing {path}: no MoE calls in it", field="routing")
    return calls


def _model_table(report: dict, device, top: int):
    c = report["constants"]
    click.echo(f"{device.name} x {report['devices']}, context {report['context']}, routing {report['routing']}")
    click.echo(f"  HBM {device.hbm_bytes_per_s / 1e12:.2f} TB/s x copy {c['copy_fraction']:.2f} = "
               f"{c['copy_bytes_per_s'] / 1e12:.2f} TB/s; issue {device.issue_per_s / 1e12:.1f} T lane-instructions/s "
               f"(per weight element: {', '.join(f'{k} {v}' for k, v in c['issue_per_element'].items())}); "
               f"{c['launch_s'] * 1e6:.1f} us per launch in a graph; "
               + (f"a sum over symmetric memory: a {c['symm_wait_s'] * 1e6:.0f} us wait in its consumer + the "
                  "peers' partials" if report["allreduce"] == "symm" else
                  f"all-reduce {c['allreduce_latency_s'] * 1e6:.0f} us + payload")
               + f" over NVLink {device.nvlink_bytes_per_s / 1e9:.0f} GB/s; host memory over {c['host_link']}")
    for cyc in report["cycles"]:
        n, p = cyc["count"], cyc["prediction"]
        name = "plain" if not cyc["draft_tokens"] else f"k={cyc['draft_tokens']}"
        b = n["bytes_per_step"]
        click.echo(f"{name} cycle ({n['cycle']}, {n['width']} rows): {n['launches_per_cycle']} launches "
                   f"({n['launches_per_layer']} per layer at most), {n['collectives']['per_cycle']} collectives, "
                   f"{b['total'] / 1e9:.2f} GB read per rank (ideal {b['ideal'] / 1e9:.2f}, {b['ratio']:.2f}x), "
                   f"{n['host_syncs_per_cycle']} host syncs, {n['host_link']['bytes_per_cycle'] / 1e3:.1f} KB read "
                   f"from host memory in {n['host_link']['launches_per_cycle']} launches")
        for label, q in p.items():
            terms = " + ".join(f"{t.replace('_', ' ')} {v * 1e3:.3f}" for t, v in q["terms_s"].items() if v)
            click.echo(f"  {label:<31} {terms} = {q['cycle_s'] * 1e3:6.3f} ms/cycle, "
                       f"{q['tokens_per_cycle']:.2f} tok/cycle, {q['tokens_per_s']:7.1f} tok/s "
                       f"(dominant: {q['dominant']})")
        click.echo("  kernels, the slowest first (ms a cycle with their launch cost; bound):")
        for kern in p["counted"]["kernels"][:top]:
            click.echo(f"    {kern['kernel']:<44}{kern['launches']:>5} launches {kern['s'] * 1e3:7.3f} ms  "
                       f"{kern['bound']}")
        for what, options in cyc["placement"].items():
            if options:
                click.echo(f"  placement of the {what.replace('_', ' ')}: " + ", ".join(
                    f"{k.replace('_', ' ')} {v * 1e3:.3f} ms" for k, v in options.items() if k != "cheaper")
                    + f" (cheaper: {options['cheaper'].replace('_', ' ')})")
        a, anchors = cyc["against_anchors"], report["anchors"]
        click.echo(f"  against the anchors: {a['tokens_per_s']:.0f} tok/s = {a['vs_vllm_p90']:.2f}x vLLM's P90 "
                   f"{anchors['vllm_p90_tokens_per_s']:.0f} tok/s; {a['ms_per_token']:.3f} ms a token = "
                   f"{a['vs_sglang_dspark_tpot']:.2f}x SGLang's DSpark TPOT {anchors['sglang_dspark_tpot_ms']} ms "
                   f"(above 1: faster)")


PREFILL_PROMPTS = (32768, 131072, 855000)  # the prompts `bench model --prefill` prices (issue 31's goal)


def _prefill_model(cfg, model_dir, n_devices, device, context, chunk, dtype, experts, allreduce, top, as_json):
    from appliance.loader import default_model_dir
    from appliance.measure import costmodel as cm
    from appliance.measure.count import count_prefill, last_chunk_start
    from appliance.measure.shapes import meta_model

    check_range("--chunk", chunk, 16)
    longest = max(context, *PREFILL_PROMPTS)
    prompts = sorted({*PREFILL_PROMPTS, context})
    mm = meta_model(cfg, dtype, drafter=False, world=n_devices, experts=experts, allreduce=allreduce)
    last_start = last_chunk_start(longest, chunk)  # the longest prompt's last chunk, priced whole
    state = mm.model.new_state(last_start + chunk, device="meta")
    counts = []
    for start in (0, last_start):
        if not as_json:
            click.echo(f"counting a {chunk}-token chunk at position {start} ...", err=True)
        counts.append(count_prefill(mm.model, state, start, chunk))
    report = {"model": str(model_dir or default_model_dir()), "devices": n_devices, "gpu": device.name,
              "allreduce": allreduce,
              "constants": cm.constants(device), "anchors": cm.PREFILL_ANCHORS,
              "prefill": cm.prefill(*counts, device, n_devices, prompts),
              "link_floor_bytes": cm.dispatch_floor_bytes(cfg, chunk, n_devices)}
    if as_json:
        click.echo(json.dumps(report, indent=1, default=str))
        return
    p = report["prefill"]
    click.echo(f"{device.name} x {n_devices}: prefill in chunks of {p['chunk']} (eager, as long calls: products in "
               "programs of 128 rows, 32 on sm_89/90; the streams, indexer and expert sums shared out by rows)")
    for start, c in p["chunks"].items():
        terms = " + ".join(f"{t.replace('_', ' ')} {v * 1e3:.1f}" for t, v in c["terms_s"].items() if v)
        click.echo(f"  chunk at {start}: {c['launches']} launches ({c['launches_per_layer']} a layer at most), "
                   f"{c['collectives']} collectives sending {c['link_bytes_sent'] / 1e9:.2f} GB a rank, "
                   f"{c['bytes_read'] / 1e9:.1f} GB read, {c['bytes_written'] / 1e9:.1f} GB written, "
                   f"{c['flops']['products'] / 1e12:.1f} TFLOP products + "
                   f"{c['flops']['attention'] / 1e12:.1f} TFLOP attention and indexer a rank, "
                   f"{c['scratch_bytes'] / 1e9:.1f} GB scratch")
        click.echo(f"    {terms} = {c['chunk_s'] * 1e3:.1f} ms ({p['chunk'] / c['chunk_s']:,.0f} tok/s; "
                   f"dominant: {c['dominant']}); slowest: " + ", ".join(
                       f"{k['kernel'].removeprefix('kernels.')} {k['s'] * 1e3:.1f} ms ({k['bound']})"
                       for k in c["kernels"][:top]))
    for q in p["prompts"]:
        click.echo(f"  {q['prompt']:>7} tokens: TTFT {q['ttft_s']:8.2f} s, {q['tokens_per_s']:>9,.0f} tok/s on "
                   f"average, the last chunk {q['last_chunk_tokens_per_s']:>9,.0f} tok/s")
    click.echo(f"  links: at least {report['link_floor_bytes'] / 1e9:.2f} GB a rank a chunk for any split that keeps "
               "the experts sharded (their tokens' dispatch: costmodel.dispatch_floor_bytes)")
    a = report["anchors"]
    click.echo(f"  anchor: {a['sglang_gb300_r1_128k_ttft_s']} s TTFT for a 128K prompt (SGLang, DeepSeek-R1, GB300); "
               f"goal: {a['goal_32k_ttft_s']} s at 32K, {a['goal_855k_ttft_s']} s at 855K")


@bench.command("prefill")
@run_options(leave_out=("draft", "draft_tokens", "context", "no_graphs"))
@click.option("--tokens", type=int, default=1024, show_default=True, help="prompt length")
@click.option("--gpu", type=click.Choice(["auto", "none", *GPU_KINDS]), default="auto", show_default=True,
              help="price the counted chunks on this GPU's constants beside the measured time (auto: this "
                   "machine's GPU when the cost model knows it)")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_prefill(options: RunOptions, tokens, gpu, as_json):
    """Prefill throughput: a prompt of random ids processed in chunks of --chunk, each chunk timed; the first
    and the last chunk are also counted on the meta build (launches, collectives, bytes read, scratch: what
    `bench model --prefill` prices) and priced on --gpu, so the measured time stands beside the model's."""
    from appliance.measure import bench as mb
    from appliance.measure import costmodel as cm

    check_range("--tokens", tokens, 1)
    loop = _loop(dataclasses.replace(options, graphs=False), tokens + 8)
    row = mb.measure_prefill(loop.session, tokens)
    world = loop.session.world.size if loop.session.world else 1
    kind = _gpu_kind(loop.session.device) if gpu == "auto" else None if gpu == "none" else gpu
    counted = mb.count_prefill_chunks(loop.session.cfg, options, world, row["chunks"])
    measured = {c["start"]: c for c in row["chunks"]}
    row["counted"] = [{"start": c["start"], "rows": c["chunk"], "measured_ms": measured[c["start"]]["ms"],
                       "launches": c["launches_per_chunk"], "collectives": c["collectives"]["per_cycle"],
                       "collective_bytes": c["collective_bytes"], "bytes_read": c["bytes_per_step"]["total"],
                       "bytes_written": c["bytes_per_step"]["written"],
                       "scratch_bytes": c["scratch_bytes"], "flops": c["flops"],
                       "modeled_ms": cm.cycle_time(c, cm.GPUS[kind], world)["cycle_s"] * 1e3 if kind else None}
                      for c in counted]
    row["gpu"] = kind
    if as_json:
        click.echo(json.dumps(row))
        return
    click.echo(f"prefill {tokens} tokens in chunks of {row['chunk']}: {row['ms']:.1f} ms, "
               f"{row['tokens_per_s']:.1f} tokens/s")
    for c in row["counted"]:
        modeled = f"; modeled on {kind}: {c['modeled_ms']:.2f} ms" if kind else ""
        click.echo(f"  chunk at {c['start']} ({c['rows']} rows): measured {c['measured_ms']:.1f} ms; counted "
                   f"{c['launches']} launches, {c['collectives']} collectives ({c['collective_bytes'] / 1e6:.1f} MB), "
                   f"{c['bytes_read'] / 1e9:.3f} GB read, {c['bytes_written'] / 1e9:.3f} GB written, "
                   f"{c['scratch_bytes'] / 1e6:.1f} MB scratch{modeled}")


def _gpu_kind(device) -> str | None:
    """The cost model's name for this machine's GPU, None on CPU or a GPU it has no constants for."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device).lower()
    return next((kind for kind in GPU_KINDS if kind in name), None)


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
