"""Where decode time goes, measured side by side in one run (the library behind `appliance bench`).

- forward: the device time of one decode cycle (draft + verify + accept + commit when drafting): CUDA
  events around the graph replay, or the wall time of the eager step on CPU;
- decode: end-to-end tokens/s of the request loop; `host ms` = cycle time - device time per cycle is the
  host overhead (the copy back, bookkeeping, detokenizing, events);
- bytes read per step (weights that a token touches + decode state read) and, on a GPU, the fraction of the
  device copy bandwidth measured once per run: the roofline of decode.
Medians and p90 over steps; every number comes with the context depth it was taken at.
"""

import statistics
import time

import torch

from appliance.api import Error, Request, Sampling, Tokens
from appliance.errors import ApplianceError
from kernels.bench import copy_bandwidth as _copy_bandwidth

from .selections import routed_experts


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "n": len(xs)}


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write counted), measured once; None on CPU."""
    return _copy_bandwidth(device, 1 << 28) if device.type == "cuda" else None


class DeviceTimer:
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


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (max(n, 1),), generator=g).tolist()


def measure_decode(loop, context: int, tokens: int, force_accept: int | None = None, seed: int = 0) -> dict:
    """Prefill `context` random ids, then generate `tokens` greedily (EOS ignored) through the request loop.
    Times every cycle step (device time, through the graph set's timing hook) and every decode cycle end
    to end."""
    session = loop.session
    prompt = random_prompt(session.cfg.vocab_size, context, seed)
    session.reset()
    if session.spec is not None:
        session.spec.force_accept = force_accept
    forward_ms: list[float] = []  # device time of each cycle step (graph replay or eager step)

    def timed(key, run):
        with DeviceTimer(session.device) as t:
            out = run()
        forward_ms.append(t.ms)
        return out

    session.graphs.timer = timed
    t0 = time.perf_counter()
    req = Request(id="bench", input_ids=prompt, max_tokens=tokens, ignore_eos=True, sampling=Sampling())
    stamps, done = [], None
    try:
        for event in loop.run(req):
            if isinstance(event, Tokens) and event.ids:
                stamps.append((time.perf_counter(), len(event.ids)))
            elif isinstance(event, Error):
                raise ApplianceError(event.message, field=event.param, code=event.code)
            else:
                done = event
    finally:
        session.graphs.timer = None
    per_cycle = [(b[0] - a[0]) * 1e3 for a, b in zip(stamps, stamps[1:])]
    per_token = [(b[0] - a[0]) * 1e3 / b[1] for a, b in zip(stamps, stamps[1:])]
    generated = sum(n for _, n in stamps)
    decode_s = stamps[-1][0] - stamps[0][0] if len(stamps) > 1 else float("nan")
    result = {
        "context": len(prompt), "tokens": generated, "prefill_ms": (stamps[0][0] - t0) * 1e3,
        "ms_per_token": quantiles(per_token), "tokens_per_s": (generated - stamps[0][1]) / decode_s,
        "cycle_ms": quantiles(per_cycle), "forward_ms": quantiles(forward_ms),
        "e2e_s": time.perf_counter() - t0,
    }
    # what a cycle spends outside its device steps: host work (the copy back, bookkeeping, detokenizing, events)
    cycles = max(len(per_cycle), 1)
    result["device_ms_per_cycle"] = sum(forward_ms[-cycles * max(len(forward_ms) // cycles, 1):]) / cycles
    result["host_ms_per_cycle"] = statistics.mean(per_cycle) - result["device_ms_per_cycle"] if per_cycle else 0.0
    if getattr(done, "speculative", None):
        result["speculative"] = done.speculative
    return result


def measure_cycle(session, context: int, repeats: int, seed: int = 0) -> dict:
    """The device time of one decode cycle after `context` positions: the session's cycle steps (one
    graph replay each on CUDA with graphs, the eager steps otherwise), run `repeats` times at the same
    position (a cycle's writes are idempotent until the host commits them, which it does not here)."""
    from .count import cycle_keys

    session.reset()
    session.prefill_all(random_prompt(session.cfg.vocab_size, context, seed))
    n = session.state.length
    if session.spec is not None:  # the steady cycle's drafter state, as session.cycle leaves it
        session.spec.catch_up(n)
    buf = session.buffers
    keys = cycle_keys(session, n)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            buf.load(1, n)
            with DeviceTimer(session.device) as t:
                for key in keys:
                    session.graphs.run(key)
            if i:  # the first run warms up (eager steps' first calls make the kernels' caches)
                times.append(t.ms)
    return {"context": n, "width": 1 + (session.spec.k if session.spec is not None else 0),
            "graphs": session.graphs.capturing, "forward_ms": quantiles(times)}


def allocated_now(devices: str, before=None):
    """What this process holds on its device: CUDA's allocated bytes, or on the CPU the live tensors'
    bytes (shapes.live_bytes). With `before` (a value this returned earlier): what was added since."""
    from .shapes import live_bytes, live_spans

    if devices.startswith("cpu"):
        return live_spans("cpu") if before is None else live_bytes("cpu", before)
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated()
    return now if before is None else now - before


def memory_against_plan(lm, options, allocated: int, world: int) -> dict:
    """What the load allocated beside what the plan says the weights, copies and caches take (the decode
    state and graph buffers come later, with the session)."""
    from .memory import fast_path_plan

    plan = fast_path_plan(lm.cfg, 1, world=world, dtype=options.dtype, drafter=lm.drafter is not None,
                          graphs=False)
    expected = plan.parts["weights"] + plan.parts["float_copies_and_caches"]
    return {"allocated": allocated, "plan": expected, "ratio": allocated / expected, "plan_parts": plan.parts,
            "largest_copies": plan.details["largest_copies"]}


def graph_chain_us(device: torch.device, step, launches: int = 2000) -> float:
    """Microseconds per launch of `launches` calls of `step(x) -> x` (one small kernel each, each reading the
    last one's output) captured in one CUDA graph and replayed: the median of five replays after warm-up."""
    x = torch.randn(1, 1024, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(launches):
            y = step(y)
    graph.replay()
    times = []
    for _ in range(5):
        with DeviceTimer(device) as t:
            graph.replay()
        times.append(t.ms)
    return statistics.median(times) * 1e3 / launches


def measure_launch_latency(device: torch.device) -> float | None:
    """Microseconds per kernel of a chain of small dependent torch kernels in a graph (`graph_chain_us`: the
    per-launch term of the cost model, costmodel.LAUNCH_S); None without CUDA."""
    return graph_chain_us(device, lambda x: x.add_(1.0)) if device.type == "cuda" else None


def measure_dependent_launch(device: torch.device) -> dict | None:
    """Microseconds per kernel of a chain of small dependent Triton kernels in a graph (`graph_chain_us`: the
    RMSNorm of a row, each normalizing the last one's output), launched with programmatic dependent launch
    (`pdl`, the kernels' default on sm_90 and later) and without (`dependent_launches(False)`):
    costmodel.LAUNCH_PDL_S against LAUNCH_S. None without CUDA."""
    if device.type != "cuda":
        return None
    from kernels import rmsnorm
    from kernels._triton import dependent_launches

    w = torch.ones(1024, device=device)
    per = {}
    for key, on in (("pdl", True), ("no_pdl", False)):
        with dependent_launches(on):
            per[key] = graph_chain_us(device, lambda x: rmsnorm.fast(x, w, 1e-6))
    return per


def measure_phase_wait(device: torch.device, phases: int = 8) -> dict | None:
    """Microseconds a dependent step costs inside one launch against a launch of its own (kernels/phases.py
    `chain`: a step of 8 programs, each reading another program's block of the step before), in a graph
    (`graph_chain_us`): `in_launch` per phase of launches of `phases` phases, `per_launch` per launch of one
    phase, each launched dependent on the one ahead (PDL). A layer's dependent launches folded into phases of
    one launch save per_launch - in_launch each; the cost model prices a boundary at LAUNCH_PDL_S until
    this is measured. None without CUDA."""
    if device.type != "cuda":
        return None
    from kernels.phases import chain

    return {"in_launch": graph_chain_us(device, lambda x: chain(x, phases, 8), 2000 // phases) / phases,
            "per_launch": graph_chain_us(device, lambda x: chain(x, 1, 8))}


def measure_prefill(session, tokens: int) -> dict:
    """A prompt of `tokens` random ids prefilled from an empty state, each chunk timed on its own (`chunks`:
    start, rows, ms; a chunk's timer waits for the device, as the request loop's progress event does)."""
    ids = random_prompt(session.cfg.vocab_size, tokens)
    session.reset()
    chunks = []
    with DeviceTimer(session.device) as total:
        session.prepare(ids)
        steps = session.prefill(ids)
        start = session.state.length
        while True:
            with DeviceTimer(session.device) as t:
                done = next(steps, None)
            if done is None:
                break
            chunks.append({"start": start, "rows": done - start, "ms": t.ms})
            start = done
    return {"tokens": tokens, "chunk": session.chunk, "ms": total.ms, "tokens_per_s": tokens / (total.ms / 1e3),
            "chunks": chunks}


def count_prefill_chunks(cfg, options, world: int, chunks: list[dict]) -> list[dict]:
    """The first and the last of a measured prefill's `chunks` (measure_prefill) counted on the meta build of
    the same model, split and dtype (count.count_prefill): what `bench model --prefill` prices, beside the
    measured time."""
    from .count import count_prefill
    from .shapes import meta_model

    mm = meta_model(cfg, options.dtype, drafter=False, world=world, experts=options.experts,
                    allreduce="nccl" if options.allreduce == "nccl" else "symm")  # auto: symm, as on the box
    picked = chunks[:1] + chunks[1:][-1:]
    state = mm.model.new_state(picked[-1]["start"] + picked[-1]["rows"], device="meta")
    return [count_prefill(mm.model, state, c["start"], c["rows"]) for c in picked]


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


def routed_calls(session, tokens: list[int], width: int) -> list[list[list[int]]]:
    """Route the sequence again in blocks of `width` rows (teacher-forced, no state kept): every MoE call's
    rows' selected experts, in layer order within a block (the cost model's `--routing` lines)."""
    state = session.model.new_state(len(tokens) + 8)
    t = torch.tensor(tokens, device=session.device)
    with routed_experts(session.model) as log:
        for s in range(0, len(tokens) - width + 1, width):
            session.model.forward(t[s:s + width], state, logits="last")
    return [idx.tolist() for idx in log]


def measure_balancedness(session, tokens: list[int], width: int, ranks: int) -> dict:
    """The expert-parallel balancedness of verify blocks of `width` rows (routed_calls) beside uniform random
    routing of the same shapes."""
    cfg = session.cfg
    measured = balancedness([torch.tensor(c) for c in routed_calls(session, tokens, width)], cfg.n_routed_experts,
                            ranks)
    g = torch.Generator().manual_seed(0)
    uniform = [torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.n_activated_experts]
                            for _ in range(width)]) for _ in range(200)]
    return {"ranks": ranks, "width": width, "measured": measured,
            "uniform_random": balancedness(uniform, cfg.n_routed_experts, ranks)}


def transformers_decode(loop, model_dir, context: int, tokens: int) -> dict:
    """transformers' generate() on the same checkpoint and prompt, greedy; our tokens must be identical."""
    from transformers import DeepseekV4ForCausalLM

    prompt = torch.tensor(random_prompt(loop.session.cfg.vocab_size, context))
    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.generate(prompt.unsqueeze(0), max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(prompt.unsqueeze(0), max_new_tokens=tokens, do_sample=False)[0, len(prompt):]
        dt = time.perf_counter() - t
    ours = []
    loop.session.reset()
    for event in loop.run(Request(input_ids=prompt.tolist(), max_tokens=tokens, ignore_eos=True)):
        ours += getattr(event, "ids", [])
    return {"tokens_per_s": tokens / dt, "identical_tokens": ours == out.tolist()}


def measure_collectives(sums: dict, sizes: list[int], device: torch.device, repeats: int = 50) -> list[dict]:
    """Latency of each fixed-order sum over ranks (`sums`: name -> callable, every rank calling in step) at
    each payload of `sizes` float32 values: median and p90 microseconds of a call, device time included
    (a synchronize after each call on CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name, fn in sums.items():
        for n in sizes:
            x = torch.full((n,), 1.0, device=device)
            for _ in range(3):
                fn(x)
            times = []
            for _ in range(repeats):
                sync()
                t = time.perf_counter()
                fn(x)
                sync()
                times.append((time.perf_counter() - t) * 1e6)
            rows.append({"allreduce": name, "values": n, "bytes": 4 * n, "us": quantiles(times)})
    return rows
