"""Kernel micro-benchmarks at V4.1-Flash decode shapes: time, bytes moved, GB/s, fraction of copy bandwidth.

For each op and M in {1, 6} rows: the median of many timed calls (CUDA events around each call),
rotating through enough input sets (weights included) that their total exceeds the L2 cache, so no call
finds its operands cached. Bytes moved are the reference docstrings' counts (what the op must read and
write at least once). The roofline is a large device-to-device copy measured once (bytes read + written
per second).

Without CUDA nothing here is meaningful: `run()` says so, and with `tiny=True` runs the same harness at
toy shapes under the Triton interpreter (labelled as such; the CPU tests use it to keep this code
working). Imports nothing of the project above kernels/.
"""

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from . import attention, engram, indexer, linear, mhc, moe, phases, query_inputs, rmsnorm, rope, sampling
from .formats import encode_fp4, encode_fp8
from .linear import PackedWeight
from .phases import launched_apart

L2_BYTES = 64 << 20  # rotate through at least 4x this (H200: 50 MB L2)


# --- random operands (shared with the tests) --------------------------------------------------------------


def fp8_weight(n: int, k: int, block: tuple[int, int] = (32, 32), device="cpu", gain: float = 1.0) -> PackedWeight:
    """A random FP8 e4m3 weight [n, k] with E8M0 block scales, values ~ N(0, gain^2 / k)."""
    data, scale = encode_fp8(torch.randn(n, k, device=device) * (gain / math.sqrt(k)), block)
    return PackedWeight("bench.fp8", (n, k), "fp8", data, scale, block)


def fp4_weight(n: int, k: int, device="cpu", gain: float = 1.0) -> PackedWeight:
    """A random FP4 e2m1 weight [n, k] (packed two per byte) with one E8M0 scale per 32 inputs."""
    data, scale = encode_fp4(torch.randn(n, k, device=device) * (gain / math.sqrt(k)))
    return PackedWeight("bench.fp4", (n, k), "fp4", data, scale, (1, 32))


def dense_weight(n: int, k: int, dtype=torch.bfloat16, device="cpu") -> PackedWeight:
    return PackedWeight("bench.dense", (n, k), "dense", (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype))


# --- shapes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    dim: int = 5120
    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora: int = 1280
    o_groups: int = 8
    o_lora: int = 1024
    experts: int = 384
    top_k: int = 6
    inter: int = 2304
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 512
    index_rows: int = 65536  # compressed rows scored (131K tokens of context at ratio 2)
    window: int = 128
    comp_rows: int = 65536
    hc: int = 4
    vocab: int = 129280
    block: int = 32
    engram_layers: int = 2
    engram_ngram: int = 4  # n-grams of 2..4 tokens, each hashed by engram_heads heads: 24 rows a position
    engram_heads: int = 8
    engram_dim: int = 256
    engram_rows: int = 1 << 20  # 256 MB tables stand in for the released 384M rows (random rows: no cache holds them)


V41 = Shapes()
TINY = Shapes(dim=64, heads=4, head_dim=64, rope_dim=16, q_lora=64, o_groups=2, o_lora=32, experts=8, top_k=2,
              inter=64, index_heads=4, index_dim=32, index_topk=8, index_rows=100, window=16, comp_rows=100,
              vocab=300, engram_heads=2, engram_dim=32, engram_rows=1000)


@dataclass
class Result:
    op: str
    shape: str
    m: int
    time_us: float
    bytes: int
    gbps: float
    fraction: float  # of the measured copy bandwidth


# --- timing ------------------------------------------------------------------------------------------------


def _time(fn, sets: list, iters: int, cuda: bool) -> float:
    """Median seconds of fn(*sets[i % len(sets)]) over `iters` calls (after a warm-up of every set)."""
    for s in sets:
        fn(*s)
    times = []
    if cuda:
        torch.cuda.synchronize()
        for i in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*sets[i % len(sets)])
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    else:
        for i in range(iters):
            t = time.perf_counter()
            fn(*sets[i % len(sets)])
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), [()], 20, device.type == "cuda")
    return 2 * nbytes / t


def _copies(one_set_bytes: int, tiny: bool) -> int:
    return 1 if tiny else max(2, math.ceil(4 * L2_BYTES / max(1, one_set_bytes)))


def _nbytes(*ts) -> int:
    n = 0
    for t in ts:
        if isinstance(t, PackedWeight):
            n += t.nbytes
        elif isinstance(t, torch.Tensor):
            n += t.numel() * t.element_size()
    return n


# --- cases -------------------------------------------------------------------------------------------------


def _gemv_cases(s: Shapes):
    """(name, out, in, format) of the decode GEMMs."""
    b = (s.block, s.block)
    return [("wq_a fp8", s.q_lora, s.dim, b), ("wq_b fp8", s.heads * s.head_dim, s.q_lora, b),
            ("wkv fp8", s.head_dim, s.dim, b), ("wo_b fp8", s.dim, s.o_groups * s.o_lora, b),
            ("shared w1 fp8", s.inter, s.dim, b), ("expert w1 fp4", s.inter, s.dim, "fp4"),
            ("expert w2 fp4", s.dim, s.inter, "fp4"), ("w fp8 128x128", s.inter, s.dim, (128, 128))]


def _bench_linear(s, m, dev, dt, iters, tiny):
    out = []
    for name, n, k, fmt in _gemv_cases(s):
        if tiny and fmt == (128, 128):
            continue
        def make(n=n, k=k, fmt=fmt):
            return fp4_weight(n, k, dev) if fmt == "fp4" else fp8_weight(n, k, fmt, dev)

        w0 = make()
        copies = _copies(w0.nbytes, tiny)
        sets = [(torch.randn(m, k, device=dev).to(dt), w0 if i == 0 else make()) for i in range(copies)]
        t = _time(lambda x, w: linear.fast(x, w, s.block, dt), sets, iters, dev.type == "cuda")
        out.append((f"linear {name}", f"[{n}, {k}]", t, w0.nbytes + m * k * dt.itemsize + m * n * dt.itemsize))
    return out


def _bench_query_inputs(s, m, dev, dt, iters, tiny):
    """An index-source layer's query products with the attention's row work in their launch."""
    b, nq, ni = (s.block, s.block), s.heads * s.head_dim, s.index_heads * s.index_dim
    products = [linear.Product(fp8_weight(nq, s.q_lora, b, dev), s.block, dt),
                linear.Product(fp8_weight(ni, s.q_lora, b, dev), s.block, dt)]
    norm = (torch.rand(s.q_lora, device=dev), 1e-6)
    pos = torch.arange(1000, 1000 + m, device=dev)
    tables = rope.table(torch.arange(1000 + m, device=dev), torch.rand(s.rope_dim // 2, device=dev))
    ring = torch.zeros(s.window + m, s.head_dim, device=dev).to(dt)
    kv_norm = torch.rand(s.head_dim, device=dev)
    sets = [(torch.randn(m, s.q_lora, device=dev).to(dt), torch.randn(m, s.head_dim, device=dev).to(dt),
             torch.randn(m, s.index_heads, device=dev).to(dt)) for _ in range(_copies(2 * s.q_lora * (nq + ni), tiny))]
    t = _time(lambda x, kv, iw: query_inputs.fast(x, products, norm, kv, pos, tables, kv_norm, 1e-6, ring, True, True,
                                                  s.index_heads, iw, 0.1), sets, iters, dev.type == "cuda")
    nbytes = sum(p.weight.nbytes for p in products) + m * (s.q_lora + 2 * s.head_dim + nq + ni) * dt.itemsize
    return [("query products + row work", f"[{nq}+{ni}, {s.q_lora}] H={s.heads} r={s.rope_dim}", t, nbytes)]


def _bench_moe(s, m, dev, dt, iters, tiny):
    experts = [(fp4_weight(s.inter, s.dim, dev), fp4_weight(s.dim, s.inter, dev), fp4_weight(s.inter, s.dim, dev))
               for _ in range(s.experts)]
    shared = (fp8_weight(s.inter, s.dim, (s.block,) * 2, dev), fp8_weight(s.dim, s.inter, (s.block,) * 2, dev),
              fp8_weight(s.inter, s.dim, (s.block,) * 2, dev))
    gate = dense_weight(s.experts, s.dim, torch.bfloat16, dev)
    bias = torch.zeros(s.experts, device=dev)
    sets = []
    for _ in range(8 if not tiny else 1):  # different rows choose different experts: weights rotate
        x = torch.randn(m, s.dim, device=dev).to(dt)
        X = torch.randn(m, 4, s.dim, device=dev).to(dt)
        sets.append((x, X))
    post, comb = torch.rand(m, 4, device=dev), torch.rand(m, 4, 4, device=dev)
    cuda = dev.type == "cuda"
    picks = []

    def ffn(x, X):
        out = moe.fast_ffn(x, gate, bias, s.top_k, "sqrtsoftplus", 1.5, 1e-20, None, experts, shared, s.block, 10.0,
                           True, X, post, comb)
        picks.append(out[2])
        return out

    t = _time(ffn, sets, iters, cuda)
    with launched_apart():  # the router, gate and up, and down in three launches: what their one launch saves
        t_apart = _time(ffn, sets, iters, cuda)
    distinct = statistics.mean(len(torch.unique(i)) for i in picks)
    nbytes = int(distinct * _nbytes(*experts[0]) + _nbytes(*shared) + gate.nbytes + 10 * m * s.dim * dt.itemsize)
    shape = f"E={s.experts} k={s.top_k} I={s.inter}"
    return [("moe sub-block fp4 (router, experts, shared, expand)", shape, t, nbytes),
            ("moe sub-block fp4, router and experts in 3 launches", shape, t_apart, nbytes)]


def _bench_attention(s, m, dev, dt, iters, tiny):
    sets = []
    nc = s.comp_rows
    for _ in range(_copies(nc * s.head_dim * dt.itemsize, tiny)):
        q = torch.randn(m, s.heads, s.head_dim, device=dev).to(dt)
        win = torch.randn(s.window + m, s.head_dim, device=dev).to(dt)
        # each query sees the window's last s.window keys, in position order (as the model lists them)
        rows = (torch.arange(s.window, device=dev) + torch.arange(m, device=dev)[:, None] + 1).contiguous()
        comp = torch.randn(nc, s.head_dim, device=dev).to(dt)
        idx = torch.randint(0, nc, (m, s.index_topk), device=dev)
        sets.append((q, win, rows, comp, idx))
    sink = torch.randn(s.heads, device=dev)
    t = _time(lambda q, w, mk, c, i: attention.fast(q, w, mk, c, i, sink, s.head_dim ** -0.5, dt if dt !=
                                                     torch.float32 else None), sets, iters, dev.type == "cuda")
    e = dt.itemsize
    nbytes = 2 * m * s.heads * s.head_dim * e + (s.window + m) * s.head_dim * e + m * s.index_topk * s.head_dim * e
    return [("attention", f"H={s.heads} d={s.head_dim} keys={s.window}+{s.index_topk}", t, nbytes)]


def _bench_indexer(s, m, dev, dt, iters, tiny):
    n = s.index_rows
    sets = []
    for _ in range(_copies(n * s.index_dim * dt.itemsize, tiny)):
        q = torch.randn(m, s.index_heads, s.index_dim, device=dev).to(dt)
        w = torch.randn(m, s.index_heads, device=dev).to(dt)
        keys = torch.randn(n, s.index_dim, device=dev).to(dt)
        sets.append((q, w, keys))
    positions = torch.full((m,), n - 1, device=dev)  # every row visible (ratio 1)
    cuda = dev.type == "cuda"
    rd = dt if dt != torch.float32 else None
    t = _time(lambda q, w, k: indexer.fast_scores(q, w, k, positions, 1, rd), sets, iters, cuda)
    out = [("index scores", f"N={n} {s.index_heads}x{s.index_dim}", t, n * s.index_dim * dt.itemsize + 4 * m * n)]
    scores = [(indexer.fast_scores(q, w, k, positions, 1, rd),) for q, w, k in sets]
    t = _time(lambda sc: indexer.fast_select(sc, s.index_topk), scores, iters, cuda)
    out.append(("index select", f"N={n} k={s.index_topk}", t, 4 * m * n + 8 * m * s.index_topk))
    top = 2048 if not tiny else 4
    t = _time(lambda sc: indexer.fast_select(sc, s.index_topk, positions, 1, 8, top), scores, iters, cuda)
    out.append(("index select + candidate blocks", f"N={n} block 8", t, 4 * m * n + 8 * m * (top + s.index_topk)))
    inside = [(q, w, k, indexer.fast_select(sc, s.index_topk, positions, 1, 8, top)[1])
              for (q, w, k), (sc,) in zip(sets, scores)]
    t = _time(lambda q, w, k, b: indexer.fast_scores(q, w, k, positions, 1, rd, inside=b, block=8), inside, iters,
              cuda)
    out.append(("index scores inside the blocks", f"{top} blocks of 8", t,
                8 * m * top * (s.index_dim * dt.itemsize + 4)))  # each row's keys (gathered) and scores
    # a long call's: the blocks' maxima alone, the candidate blocks chosen from them
    t = _time(lambda q, w, k: indexer.fast_scores(q, w, k, positions, 1, rd, maxima=8), sets, iters, cuda)
    out.append(("index block maxima", f"N={n} block 8", t, n * s.index_dim * dt.itemsize + 4 * m * n // 8))
    maxima = [(indexer.fast_scores(q, w, k, positions, 1, rd, maxima=8),) for q, w, k in sets]
    t = _time(lambda mx: indexer.fast_select(mx, 0, positions // 8, 1, 1, top), maxima, iters, cuda)
    out.append(("candidate blocks from maxima", f"{n // 8} blocks", t, 4 * m * n // 8 + 8 * m * top))
    return out


def _bench_engram(s, m, dev, dt, iters, tiny):
    """The lookup of every Engram layer for m positions, from tables in host memory (pinned: the device reads
    them in place, as it reads the registered checkpoint pages) and, beside it, from the same tables on the
    device: the difference is what the host link costs a step. Then one Engram layer on looked-up rows.
    Bytes: the rows a lookup reads (over the host link in the first row); the layer's wkv, rows and streams."""
    cuda = dev.type == "cuda"
    L, hd, rows = s.engram_layers, s.engram_dim, s.engram_rows
    C = (s.engram_ngram - 1) * s.engram_heads
    host = []
    for _ in range(L):  # random bytes: the lookup copies codes and scales, whatever they encode
        pair = (torch.randint(0, 256, (rows, hd), dtype=torch.uint8), torch.randint(0, 256, (rows, hd // 32),
                                                                                     dtype=torch.uint8))
        host.append(tuple(t.pin_memory() for t in pair) if cuda else pair)
    primes = torch.full((L, C), rows // C, device=dev)  # each column its own range of rows (offsets)
    offsets = torch.cumsum(primes, 1) - primes
    mult = torch.randint(1, 2**40, (L, s.engram_ngram), device=dev) * 2 + 1
    token_map = torch.randint(0, s.vocab, (s.vocab,), device=dev)
    history = torch.randint(0, s.vocab, (4096,), device=dev)
    sets = [(torch.arange(m, device=dev) + 64 * (i + 1),) for i in range(32)]  # other positions, other rows
    on_host = [(t.view(torch.float8_e4m3fn), sc) for t, sc in host]
    on_device = [(t.to(dev), sc.to(dev)) for t, sc in on_host]

    def lookup(pos, pairs):
        return engram.fast_lookup(history, pos, token_map, 0, mult, primes, offsets, s.engram_heads,
                                  [t for t, _ in pairs], [sc for _, sc in pairs])

    out = []
    for where, pairs in (("host", on_host), ("device", on_device)):
        t = _time(lookup, [(pos, pairs) for (pos,) in sets], iters, cuda)
        out.append((f"engram lookup, {where} tables", f"{L} layers x {C} rows of {hd} B", t,
                    L * m * C * (hd + hd // 32)))
    _, codes, scales = lookup(*sets[0], on_device)
    n = (s.hc + 1) * s.dim
    wkv = [fp8_weight(n, C * hd, (s.block,) * 2, dev) for _ in range(_copies(n * C * hd, tiny))]
    omega = torch.randn(s.hc, s.dim, device=dev)
    layer_sets = [(torch.randn(m, s.hc, s.dim, device=dev).to(dt), w) for w in wkv]
    t = _time(lambda X, w: engram.fast_layer(X, codes[0], scales[0], w, s.block, omega, 1e-20), layer_sets, iters,
              cuda)
    out.append(("engram layer", f"[{n}, {C * hd}] fp8", t,
                wkv[0].nbytes + _nbytes(codes[0], scales[0]) + 2 * m * s.hc * s.dim * dt.itemsize))
    return out


def _bench_small(s, m, dev, dt, iters, tiny):
    cuda = dev.type == "cuda"
    out = []
    n = s.hc * s.dim
    j = s.hc * (2 + s.hc)
    fn = torch.randn(j, n, device=dev) / math.sqrt(n)
    base, scale = torch.randn(j, device=dev), torch.rand(3, device=dev)
    sets = [(torch.randn(m, s.hc, s.dim, device=dev).to(dt),) for _ in range(4)]
    t = _time(lambda X: mhc.fast_coeffs(X, fn, base, scale, 1e-20, 1e-6, 20), sets, iters, cuda)
    out.append(("mhc coeffs", f"hc={s.hc} D={s.dim}", t, m * n * dt.itemsize + fn.numel() * 4))
    pre = torch.rand(m, s.hc, device=dev)
    t = _time(lambda X: mhc.fast_collapse(X, pre), sets, iters, cuda)
    out.append(("mhc collapse", f"hc={s.hc} D={s.dim}", t, m * n * dt.itemsize + m * s.dim * dt.itemsize))
    y = torch.randn(m, s.dim, device=dev).to(dt)
    comb = torch.rand(m, s.hc, s.hc, device=dev)
    nw = torch.rand(s.dim, device=dev)
    t = _time(lambda X: mhc.fast_expand_pre(y, X, pre, comb, pre, fn, base, scale, 1e-20, 1e-6, 20, nw, 1e-6), sets,
              iters, cuda)
    out.append(("mhc expand + site", f"hc={s.hc} D={s.dim}", t,
                2 * m * n * dt.itemsize + 2 * m * s.dim * dt.itemsize + fn.numel() * 4))
    w = torch.rand(s.dim, device=dev)
    xs = [(torch.randn(m, s.dim, device=dev).to(dt),) for _ in range(4)]
    t = _time(lambda x: rmsnorm.fast(x, w, 1e-20), xs, iters, cuda)
    out.append(("rmsnorm", f"D={s.dim}", t, 2 * m * s.dim * dt.itemsize + 4 * s.dim))
    qs = [(torch.randn(m, s.heads, s.head_dim, device=dev).to(dt),) for _ in range(4)]
    cos, sin = torch.rand(m, 1, s.rope_dim // 2, device=dev), torch.rand(m, 1, s.rope_dim // 2, device=dev)
    t = _time(lambda q: rope.fast(q, cos, sin), qs, iters, cuda)
    out.append(("rope q", f"H={s.heads} d={s.head_dim} r={s.rope_dim}", t, 2 * m * s.heads * s.head_dim * dt.itemsize))
    lg = [(torch.randn(m, s.vocab, device=dev),) for _ in range(4)]
    params = torch.tensor([0.8, 0.95, 0.0], device=dev)  # temperature, top_p, top_k
    key = torch.zeros(2, dtype=torch.long, device=dev)
    t = _time(lambda x: sampling.fast_sample(x, params, key), lg, max(3, iters // 4), cuda)
    out.append(("sample top-p", f"V={s.vocab}", t, 3 * 4 * m * s.vocab))
    # dependent steps in one launch (kernels/phases.py): 8 phases of 8 programs, each reading another's block
    chains = [(torch.randn(8 * 128, device=dev),) for _ in range(4)]
    t = _time(lambda x: phases.chain(x, 8, 8), chains, iters, cuda)
    out.append(("8 phases in a launch", "8 programs x 128", t, 8 * 2 * 1024 * 4))
    return out


BENCHES = (_bench_linear, _bench_query_inputs, _bench_moe, _bench_attention, _bench_indexer, _bench_engram,
           _bench_small)


def run(device: str | None = None, ms=(1, 6), iters: int = 50, tiny: bool | None = None, notice=print) -> list[Result]:
    """Benchmark every op. Without CUDA, prints why nothing is measured and returns [] unless tiny=True."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    if tiny is None:
        tiny = not cuda
    if not cuda and not tiny:
        notice("no CUDA device: kernel timings would come from the Triton interpreter and mean nothing; "
               "nothing measured")
        return []
    if not cuda:
        notice("no CUDA device: tiny shapes under the Triton interpreter (checks the harness, not the speed)")
        iters = min(iters, 3)
    shapes = TINY if tiny else V41
    dt = torch.bfloat16 if cuda else torch.float32
    bw = copy_bandwidth(dev, 1 << 30 if cuda else 1 << 22)
    results = []
    for m in ms:
        for bench in BENCHES:
            for op, shape, t, nbytes in bench(shapes, m, dev, dt, iters, tiny):
                gbps = nbytes / t / 1e9
                results.append(Result(op, shape, m, t * 1e6, nbytes, gbps, nbytes / t / bw))
    notice(f"copy bandwidth: {bw / 1e9:.0f} GB/s ({dev}{', tiny shapes, interpreter' if not cuda else ''})")
    return results


def table(results: list[Result]) -> str:
    lines = [f"{'op':<24} {'shape':<36} {'M':>2} {'time us':>9} {'MB':>9} {'GB/s':>8} {'of copy':>8}"]
    for r in results:
        lines.append(f"{r.op:<24} {r.shape:<36} {r.m:>2} {r.time_us:>9.1f} {r.bytes / 1e6:>9.2f} {r.gbps:>8.1f} "
                     f"{r.fraction:>7.0%}")
    return "\n".join(lines)


def as_json(results: list[Result]) -> list[dict]:
    return [asdict(r) for r in results]
