"""`appliance bench decode | forward | prefill`: where decode time goes, measured side by side in one run.

- forward: the device time of one decode cycle (draft + verify + accept + commit when drafting): CUDA
  events around the graph replay, or the wall time of the eager step on CPU;
- decode: end-to-end tokens/s of the generation loop; `host ms` = cycle time - device time per cycle is
  the host overhead (the copy back, bookkeeping, detokenizing, events);
- bytes read per step (weights that a token touches + decode state read) and, on a GPU, the fraction of the
  device copy bandwidth measured once per run: the roofline of decode.
Medians and p90 over steps; every number is printed with the context depth it was taken at.
"""

import json
import statistics
import time

import click
import torch

from appliance.api import Request, Sampling
from appliance.cli.bench import bench
from appliance.cli.main import friendly, model_options

from .costs import step_bytes


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "n": len(xs)}


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write counted), measured once; None on CPU."""
    if device.type != "cuda":
        return None
    n = 1 << 28
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n / statistics.median(times)


class _Timer:
    """Device time of a region: CUDA events on a GPU, wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1e3


def measure_decode(gen, context: int, tokens: int, force_accept: int | None = None, seed: int = 0) -> dict:
    """Prefill `context` random ids, then generate `tokens` greedily (EOS ignored). Times every model
    forward (device time) and every decode cycle end to end."""
    cfg = gen.cfg
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (max(context, 1),), generator=g).tolist()
    gen.state.reset()
    if gen.spec is not None:
        gen.spec.reset()
        gen.spec.force_accept = force_accept
    forward_ms: list[float] = []  # device time of each cycle step (graph replay or eager step)
    device = gen.lm.runtime.device
    runners = [gen.runner(*step) for step in gen.cycle_steps()]
    for runner in runners:
        def timed(run=runner.run):
            with _Timer(device) as t:
                out = run()
            forward_ms.append(t.ms)
            return out
        runner.run = timed
    t0 = time.perf_counter()
    req = Request(id="bench", input_ids=prompt, max_tokens=tokens, ignore_eos=True, sampling=Sampling())
    stamps, done = [], None
    try:
        first_token = None
        for event in gen.run(req):
            if type(event).__name__ == "Tokens" and event.ids:
                first_token = first_token or time.perf_counter()
                stamps.append((time.perf_counter(), len(event.ids)))
            elif type(event).__name__ == "Error":
                raise click.ClickException(event.message)
            elif type(event).__name__ == "Done":
                done = event
        prefill_ms = (first_token - t0) * 1e3
    finally:
        for runner in runners:
            del runner.run  # back to the class's method
    cycle_forward = forward_ms
    per_cycle = [(b[0] - a[0]) * 1e3 for a, b in zip(stamps, stamps[1:])]
    per_token = [(b[0] - a[0]) * 1e3 / b[1] for a, b in zip(stamps, stamps[1:])]
    generated = sum(n for _, n in stamps)
    decode_s = stamps[-1][0] - stamps[0][0] if len(stamps) > 1 else float("nan")
    result = {
        "context": len(prompt), "tokens": generated, "prefill_ms": prefill_ms,
        "ms_per_token": _quantiles(per_token), "tokens_per_s": (generated - stamps[0][1]) / decode_s,
        "cycle_ms": _quantiles(per_cycle), "forward_ms": _quantiles(cycle_forward),
        "e2e_s": time.perf_counter() - t0,
    }
    # what a cycle spends outside its device steps: host work (the copy back, bookkeeping, detokenizing, events)
    cycles = max(len(per_cycle), 1)
    result["device_ms_per_cycle"] = sum(cycle_forward[-cycles * max(len(cycle_forward) // cycles, 1):]) / cycles
    result["host_ms_per_cycle"] = statistics.mean(per_cycle) - result["device_ms_per_cycle"] if per_cycle else 0.0
    if done is not None and done.speculative:
        result["speculative"] = done.speculative
    return result


def balancedness(indices: list[torch.Tensor], n_experts: int, ranks: int) -> float:
    """Mean over verify blocks of (mean rank load / max rank load): a rank's load is the number of distinct
    experts it holds that the block's rows selected (each is read once per block)."""
    per = n_experts // ranks
    values = []
    for idx in indices:
        hit = torch.zeros(n_experts, dtype=torch.bool)
        hit[idx.flatten()] = True
        load = hit.view(ranks, per).sum(1).double()
        values.append((load.mean() / load.max()).item())
    return statistics.mean(values) if values else float("nan")


def measure_balancedness(gen, tokens: list[int], width: int, ranks: int) -> dict:
    """Route the sequence again in verify blocks of `width` rows (teacher-forced, no state kept) and compare
    the expert-parallel balancedness with uniform random routing of the same shapes."""
    cfg = gen.cfg
    moes = [layer.ffn for layer in gen.model.layers]
    logs: list[list] = [[] for _ in moes]
    for moe, log in zip(moes, logs):
        moe.routing_log = log
    state = gen.model.new_state(len(tokens) + 8)
    try:
        t = torch.tensor(tokens, device=gen.lm.runtime.device)
        for s in range(0, len(tokens) - width + 1, width):
            gen.model.forward(t[s:s + width], state, logits="last")
    finally:
        for moe in moes:
            moe.routing_log = None
    measured = statistics.mean(balancedness(log, cfg.n_routed_experts, ranks) for log in logs)
    g = torch.Generator().manual_seed(0)
    uniform = [torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.n_activated_experts]
                            for _ in range(width)]) for _ in range(200)]
    return {"ranks": ranks, "width": width, "measured": measured,
            "uniform_random": balancedness(uniform, cfg.n_routed_experts, ranks)}


def _generator(model_dir, numerics, dtype, op_path, devices, index_keys, draft, draft_tokens, capacity, graphs=True):
    from appliance.decode.generate import Generator
    from appliance.loader import load_model

    lm = load_model(model_dir, numerics=numerics, dtype=dtype, path=op_path, device=devices, notice=None,
                    load_drafter=draft != "none")
    return Generator(lm, capacity=capacity, chunk=256, index_keys=index_keys, draft=draft, draft_tokens=draft_tokens,
                     graphs=graphs)


def _report(rows: list[dict], cfg, bandwidth, as_json: bool, extra: dict | None = None):
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


def _contexts(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * scale))
    return out


@bench.command("decode")
@model_options
@click.option("--tokens", type=int, default=64, show_default=True, help="tokens to generate per run")
@click.option("--context", "contexts", default="16", show_default=True,
              help="context depth(s) to decode at, comma separated (1K = 1024); prefilled with random ids")
@click.option("--draft", type=click.Choice(["none", "dspark", "mtp", "adaptive", "auto"]), default="none",
              show_default=True, help="with a drafter, --draft none is measured in the same run for comparison")
@click.option("--draft-tokens", type=int, default=3, show_default=True)
@click.option("--force-accept", type=int, default=None,
              help="every cycle accepts exactly this many drafts (cycle cost independent of the weights)")
@click.option("--compare-transformers", is_flag=True,
              help="also run transformers' generate() on the same checkpoint (transformers format, plain "
                   "numerics) and check the tokens are identical")
@click.option("--no-graphs", is_flag=True, help="on CUDA, run cycles eagerly instead of replaying graphs")
@click.option("--ep-ranks", type=int, default=4, show_default=True,
              help="expert-parallel ranks for the balancedness of the verify step's routing")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_decode(model_dir, numerics, dtype, op_path, devices, index_keys, tokens, contexts, draft, draft_tokens,
                 force_accept, compare_transformers, no_graphs, ep_ranks, as_json):
    """Greedy decode speed: tokens/s, ms per token (median, p90), the model's forward time per cycle beside
    the end-to-end cycle time (the gap is host overhead), bytes read per step, and on a GPU the fraction
    of the measured copy bandwidth."""
    ctx = _contexts(contexts)
    capacity = max(ctx) + tokens + 64
    drafts = ["none"] if draft == "none" else ["none", draft]
    rows = []
    gens = {d: _generator(model_dir, numerics, dtype, op_path, devices, index_keys, d, draft_tokens, capacity,
                          not no_graphs) for d in drafts}
    bandwidth = copy_bandwidth(next(iter(gens.values())).lm.runtime.device)
    for c in ctx:
        for d, gen in gens.items():
            r = measure_decode(gen, c, tokens, force_accept if d != "none" else None)
            r["draft"] = d if force_accept is None or d == "none" else f"{d}@{force_accept}"
            rows.append(r)
    extra = {}
    gen = gens["none"]
    if gen.cfg.n_routed_experts % ep_ranks == 0:
        sequence = torch.randint(0, gen.cfg.vocab_size, (256,)).tolist()
        extra["expert_parallel_balancedness"] = measure_balancedness(gen, sequence, draft_tokens + 1, ep_ranks)
    if compare_transformers:
        extra["transformers"] = _transformers_decode(gens["none"], ctx[0], tokens)
    _report(rows, gens["none"].cfg, bandwidth, as_json, extra)


def _transformers_decode(gen, context: int, tokens: int) -> dict:
    """transformers' generate() on the same checkpoint and prompt, greedy; our tokens must be identical."""
    from transformers import DeepseekV4ForCausalLM

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, gen.cfg.vocab_size, (max(context, 1),), generator=g)
    model = DeepseekV4ForCausalLM.from_pretrained(str(gen.lm.model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.generate(prompt.unsqueeze(0), max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(prompt.unsqueeze(0), max_new_tokens=tokens, do_sample=False)[0, len(prompt):]
        dt = time.perf_counter() - t
    ours = []
    gen.state.reset()
    for event in gen.run(Request(input_ids=prompt.tolist(), max_tokens=tokens, ignore_eos=True)):
        ours += getattr(event, "ids", [])
    return {"tokens_per_s": tokens / dt, "identical_tokens": ours == out.tolist()}


@bench.command("forward")
@model_options
@click.option("--context", "contexts", default="16", show_default=True, help="context depth(s), comma separated")
@click.option("--width", type=int, default=1, show_default=True, help="rows per forward (a verify block: k+1)")
@click.option("--repeats", type=int, default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_forward(model_dir, numerics, dtype, op_path, devices, index_keys, contexts, width, repeats, as_json):
    """The model's own time for one decode cycle of `width` rows at each context depth (CUDA events on a
    GPU, wall time of the eager step on CPU), with bytes per step and the fraction of copy bandwidth."""
    ctx = _contexts(contexts)
    gen = _generator(model_dir, numerics, dtype, op_path, devices, index_keys, "none", 1,
                     max(ctx) + repeats * width + 8, graphs=False)
    device = gen.lm.runtime.device
    bandwidth = copy_bandwidth(device)
    rows = []
    for c in ctx:
        gen.state.reset()
        gen.prefill(torch.randint(0, gen.cfg.vocab_size, (max(c, 1),)).tolist())
        times = []
        for _ in range(repeats):
            with _Timer(device) as t:
                gen.forward([1] * width, "all")
            times.append(t.ms)
            gen.state.rewind(gen.state.length - width)
        b = step_bytes(gen.cfg, c)
        row = {"context": c, "width": width, "forward_ms": _quantiles(times), "bytes_per_step": b}
        if bandwidth:
            row["fraction_of_bandwidth"] = b["total"] / (row["forward_ms"]["median"] / 1e3) / bandwidth
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
@model_options
@click.option("--tokens", type=int, default=1024, show_default=True, help="prompt length")
@click.option("--chunk", type=int, default=256, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_prefill(model_dir, numerics, dtype, op_path, devices, index_keys, tokens, chunk, as_json):
    """Prefill throughput: a prompt of random ids processed in chunks."""
    gen = _generator(model_dir, numerics, dtype, op_path, devices, index_keys, "none", 1, tokens + 8, graphs=False)
    gen.chunk = chunk
    ids = torch.randint(0, gen.cfg.vocab_size, (tokens,)).tolist()
    device = gen.lm.runtime.device
    with _Timer(device) as t:
        gen.prefill(ids)
    row = {"tokens": tokens, "chunk": chunk, "ms": t.ms, "tokens_per_s": tokens / (t.ms / 1e3)}
    if as_json:
        click.echo(json.dumps(row))
    else:
        click.echo(f"prefill {tokens} tokens in chunks of {chunk}: {t.ms:.1f} ms, {row['tokens_per_s']:.1f} tokens/s")
