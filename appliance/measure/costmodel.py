"""A cost model of one decode cycle on a named GPU (the library behind `appliance bench model`): the counted
launches of a cycle (count.py, on a meta build of the config when the weights are absent), each with the
bytes it reads and the quantized weight elements its products stream, priced one by one, plus the
collectives, into a cycle time and tokens/s.

Assumptions (each constant below names its source):
- The cycle is one captured CUDA graph per rank; its kernels run back to back on one stream, nothing
  overlaps (no kernel hides another's latency, collectives are not overlapped with compute). A launch costs
  the largest of what bounds it plus a fixed cost (`LAUNCH_S`: the gap from one kernel's end to the next
  one's full occupancy, its ramp and tail; `LAUNCH_PDL_S` for the project's Triton kernels on sm_90 and
  later, which launch dependent on the one ahead and overlap its tail):
      launch = max(bytes / (HBM x COPY_FRACTION), issued instructions / issue rate,
                   tensor FLOPs / tensor peak, host-link reads) + launch_s + phase waits x PHASE_WAIT_S
  The bandwidth term is the copy bandwidth: a kernel's ramp and tail are in its fixed cost, not a second
  fraction. A launch of dependent phases (kernels/phases.py) pays a wait at each phase boundary, in the
  `launches` term with the launches' fixed costs.
- Bytes are what the launch reads and writes, counted (not the ideal; recorder.py says what it counts of
  the writes), both at the copy bandwidth. The bytes a launch reads from host memory (the Engram rows the
  lookup copies, ~12.7 KB per token on V4.1-Flash) go over the host link: one round trip
  (`HOST_READ_LATENCY_S`; the loads are issued together) plus the bytes at the link's bandwidth.
- Instruction issue is priced where it was measured: the weight products (linear, MoE, Engram; the main loop
  and the rows' staging), per weight element and format, as the compile check reads them from the SASS for
  the GPU's architecture (`ISSUE_PER_ELEMENT`), over the GPU's issue rate (lane-instructions per second: 32
  lanes x 4 schedulers x SMs x clock, which is half the FP32 FMA FLOPS a datasheet gives). Other kernels'
  issue is not priced (they move activations and the decode state: bytes bound by design, not measured here).
- Tensor FLOPs, as count.py declares them: the weight products' 2 x rows x weight elements, the rows padded
  to the MMA's 16 (a decode step's products are 16 rows however many it uses; a routed expert's rows are its
  share of the pairs), at the dense tensor-core peak of the path the kernels take: FP8 on every architecture
  here (the block-scaled MMA on sm_100/103, the e4m3 MMA on sm_90; FP4 weights multiply as e4m3 on both),
  bfloat16 where the weights are dequantized in registers (a plain product: `Launch.path` "registers");
  the attention's (4 x queries x heads x head dim x rows it attends) and the indexer's scores (2 x queries x
  index heads x visible key rows x index dim) at the bfloat16 peak. Their main loops issue one pass per 16
  rows (8 on the e4m3 MMA of sm_89/90 in the checkpoint's formats; in a prefill chunk's long calls 128, or
  32 on that e4m3 MMA).
- A collective costs `ALLREDUCE_LATENCY_S` plus its payload over NVLink at ring efficiency
  (all-reduce: 2 (N-1)/N of the payload per rank; all-gather: (N-1) x the rank's part). A sum over
  symmetric memory (`--allreduce symm`, the box's default; recorded "symm_" at the consumer that waits for
  it; a publish launch, where its producer does not publish, priced as a launch) costs `SYMM_WAIT_S` plus
  the (N-1) peers' partials each rank reads over NVLink; a read of parts another wait covered ("symm_read":
  DSpark's base logits, read by each Markov step whose addend's wait comes after them) costs the read alone.
- Every layer ends in a collective, so the slowest rank sets the pace. The count is one rank's, with the
  routed experts at their mean share; where the ranks hold whole experts (expert parallelism: an expert
  too small to split in whole scale blocks) the rank holding the most of a step's selected experts reads
  more. `imbalance` prices those MoE launches again with their routed part scaled to the busiest rank's
  expected load (uniform routing, a fixed-seed simulation; or measured routing), and adds the difference.
  Split experts (every rank a share of each, parallel/sharding.py) have none; `placement` prices both.
Tokens per cycle: 1 without drafting; with k drafts and a mean of A accepted drafts per cycle, A + 1 (the
accepted drafts and the token the verify adds; `speculative.mean_accepted` in this project's reports).
"""

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from kernels._triton import E4M3_LONG_ROWS, E4M3_MMA_ROWS, LONG_ROWS, MMA_ROWS


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float  # datasheet peak
    memory_bytes: float
    nvlink_bytes_per_s: float  # per GPU, one direction
    source: str
    host_link_bytes_per_s: float = 50e9  # the device reading host memory: PCIe Gen5 x16 (see HOST_LINK)
    arch: int = 0  # compute capability (90, 100, 103): whose measured instruction issue prices its products
    issue_per_s: float = 0.0  # lane-instructions per second (half the FP32 FMA FLOPS); 0: issue not priced
    tensor_flops: dict = field(default_factory=dict)  # dense tensor-core FLOP/s by operand format


GPUS = {
    "b300": GPU("NVIDIA B300 (Blackwell Ultra, SXM)", 8.0e12, 288e9, 900e9,
                "NVIDIA HGX B300 datasheet: 288 GB HBM3e at 8 TB/s per GPU; NVLink 5 at 1.8 TB/s per GPU "
                "(both directions); dense FP32 75 TFLOPS, BF16 2.25 PFLOPS, FP8 4.5 PFLOPS, FP4 13.5 PFLOPS",
                arch=103, issue_per_s=37.5e12, tensor_flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 13.5e15}),
    "b200": GPU("NVIDIA B200 (SXM)", 8.0e12, 180e9, 900e9,
                "NVIDIA HGX B200 datasheet: 180 GB HBM3e at 8 TB/s per GPU; NVLink 5 at 1.8 TB/s per GPU; dense "
                "FP32 75 TFLOPS, BF16 2.25 PFLOPS, FP8 4.5 PFLOPS, FP4 9 PFLOPS",
                arch=100, issue_per_s=37.5e12, tensor_flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15}),
    "h200": GPU("NVIDIA H200 (SXM)", 4.8e12, 141e9, 450e9,
                "NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s; NVLink 4 at 900 GB/s per GPU; dense FP32 67 "
                "TFLOPS, BF16 989 TFLOPS, FP8 1979 TFLOPS",
                arch=90, issue_per_s=33.5e12, tensor_flops={"bf16": 989e12, "fp8": 1979e12}),
    "h100": GPU("NVIDIA H100 (SXM)", 3.35e12, 80e9, 450e9,
                "NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s per GPU; dense FP32 "
                "67 TFLOPS, BF16 989 TFLOPS, FP8 1979 TFLOPS",
                arch=90, issue_per_s=33.5e12, tensor_flops={"bf16": 989e12, "fp8": 1979e12}),
}

# A device-to-device copy moved 4.3 TB/s (read + write) on an H200 of the device machines here, 0.9 of the
# 4.8 TB/s datasheet figure (measured 2026-10-28); assumed the same on every GPU.
COPY_FRACTION = 0.90
# Per kernel inside a captured graph: the lower end of issue 13's estimate (10-25 ms of launch latency for
# ~4,560 launches: 2.2-5.5 us each), rounded down; `scripts/device-check.sh` measures it (`launch_us`).
LAUNCH_S = 2.0e-6
# ... for a Triton kernel launched with programmatic dependent launch (kernels/_triton.py `pdl`: every kernel
# of theirs on sm_90 and later): its launch and ramp overlap the tail of the kernel ahead of it. Published
# measurements put a graph's kernel boundary at 1.3-3 us without it and well under 1 us with it (issue 32's
# survey, 2026-12): 1 us taken, the top of that; `scripts/device-check.sh` measures both
# (`dependent_launch_us_in_graph`). Torch's own operations keep LAUNCH_S.
LAUNCH_PDL_S = 1.0e-6
# A phase's wait inside a launch for the phase before it (kernels/phases.py: a decode step's router, gate and
# up, and down in one launch): one thread's acquire poll of a counter in L2 that the phase before's programs
# released. No published figure was found; priced as the boundary it replaces, LAUNCH_PDL_S, until the device
# check measures it (`phase_wait_us_in_graph`: a chain of phases in one launch against a launch each).
PHASE_WAIT_S = LAUNCH_PDL_S
# The device's reads of host memory (zero-copy loads of registered pages) on an HGX board: PCIe Gen5 x16 to
# the host, 64 GB/s per direction raw, taken as 50 GB/s after protocol overhead (a pinned host-to-device copy
# reaches about that); a round trip of about 1.5 us per dependent load. Both are assumptions until
# `appliance bench kernels` on the device (its "engram lookup, host tables" row) measures them.
HOST_LINK = "PCIe Gen5 x16, 50 GB/s, 1.5 us a round trip (assumed; bench kernels measures the lookup)"
HOST_READ_LATENCY_S = 1.5e-6
# Lane-instructions the weight products issue per weight element, by kernel and format: the main loop's plus
# the rows' staging before it (kernels/linear.py's `stage_codes`), the worst specialization compiled (the
# tiny models' and V4.1's shapes), read from the SASS by the compile check (`python -m tests.gpu_dry_run
# --arch 90,103`, its `issue` table; BENCHMARKS.md) at the commit that last changed them. sm_100 (B200) takes
# sm_103's: the same tcgen05 instructions. The MoE kernels' shared expert (FP8) is priced as their FP4 loop,
# and both at the worse of gate-and-up and down.
ISSUE_PER_ELEMENT = {
    90: {("linear", "fp8"): 2.20, ("linear", "fp4"): 3.18, ("moe", "fp4"): 3.64, ("moe", "fp8"): 3.64,
         ("engram", "fp8"): 2.45},
    103: {("linear", "fp8"): 2.25, ("linear", "fp4"): 2.23, ("moe", "fp4"): 2.34, ("moe", "fp8"): 2.34,
          ("engram", "fp8"): 2.36},
}
ISSUE_PER_ELEMENT[100] = ISSUE_PER_ELEMENT[103]
# ... in a long call's programs (a prefill chunk: LONG_ROWS rows a pass, the rows staged once by a launch of
# their own, so the main loop is all; the compile check's `... long` rows), per weight element and pass: of
# 128 rows on the block-scaled MMA (256 columns deep), of 32 on the e4m3 MMA (kernels/_triton.py
# `product_rows`); a long call's shared expert takes launches of its own, its FP8 loop measured apart
ISSUE_PER_ELEMENT_LONG = {
    90: {("linear", "fp8"): 4.70, ("linear", "fp4"): 6.00, ("moe", "fp4"): 7.62, ("moe", "fp8"): 5.84,
         ("engram", "fp8"): 4.59},
    103: {("linear", "fp8"): 1.68, ("linear", "fp4"): 1.82, ("moe", "fp4"): 1.95, ("moe", "fp8"): 1.95,
          ("engram", "fp8"): 1.61},
}
ISSUE_PER_ELEMENT_LONG[100] = ISSUE_PER_ELEMENT_LONG[103]
# ... of a launch whose products take the weights dequantized to bfloat16 values in registers (a plain FP8
# product of bfloat16 rows: wo_a; a launch mixing formats), short and long (the compile check's `plain` rows;
# where a format is not measured there, the native loop's figure stands in)
ISSUE_PER_ELEMENT_REGISTERS = {90: {("linear", "fp8"): 7.44}, 103: {("linear", "fp8"): 6.16}}
ISSUE_PER_ELEMENT_REGISTERS_LONG = {90: {("linear", "fp8"): 8.41}, 103: {("linear", "fp8"): 4.83}}
for _table in (ISSUE_PER_ELEMENT_REGISTERS, ISSUE_PER_ELEMENT_REGISTERS_LONG):
    _table[100] = _table[103]
WEIGHT_KERNELS = {"kernels.linear._kernel": "linear", "kernels.moe._gate_up_kernel": "moe",
                  "kernels.moe._down_kernel": "moe", "kernels.moe._step_kernel": "moe",
                  "kernels.engram._layer_kernel": "engram"}
# The best public single-user results on 4 x B300 this product is measured against (DESIGN.md): vLLM's P90
# of 826 tokens/s for one user, SGLang's 1.31 ms time per output token with DSpark drafting.
ANCHORS = {"vllm_p90_tokens_per_s": 826.0, "sglang_dspark_tpot_ms": 1.31}
# Prefill: SGLang on GB300 (DeepSeek-R1, chunked pipeline parallelism, FP8 attention), a 128K prompt in 8.6 s
# TTFT; the goal set for 4 x B300 on released V4.1-Flash (issue 31): 0.25 s at 32K, 8 s at 855K.
PREFILL_ANCHORS = {"sglang_gb300_r1_128k_ttft_s": 8.6, "goal_32k_ttft_s": 0.25, "goal_855k_ttft_s": 8.0}
# NCCL all-reduce of a small payload inside a CUDA graph on one NVLink node: about 6 us measured on 2 x
# H100 with NVLSTree and graphs (NVIDIA/nccl issue #1259); taken for 4 GPUs of any of these generations.
ALLREDUCE_LATENCY_S = 6.0e-6
# A sum over symmetric memory as the cycle takes it (parallel/collectives.py SymmSum): the producer publishes
# its partial (inside its own kernel, or a publish launch priced as a launch); left are the consumers' wait on
# the peers' flags and their reads over NVLink.
# Issue 32's survey (2026-12) puts a one-shot all-reduce over symmetric memory on B200/B300 at 3-8 us: a
# kernel that writes, signals, waits and reads, its launch included. Its low end, 3 us, is taken for the wait
# alone, on top of the publish's launch: an assumption until a box of several GPUs measures it (one lent GPU
# cannot).
SYMM_WAIT_S = 3.0e-6


def moved_bytes(op: str, payload: int, world: int) -> float:
    """Bytes one collective of `payload` bytes (this rank's input) sends from each of `world` ranks, at ring
    efficiency."""
    if world <= 1:
        return 0.0
    if "alltoall" in op:  # this rank's input holds a share for every rank: all but its own leave
        return payload * (world - 1) / world
    return payload * 2 * (world - 1) / world if "reduce" in op else payload * (world - 1)


def collective_s(op: str, payload: int, world: int, gpu: GPU) -> float:
    """Seconds for one collective of `payload` bytes (this rank's input) over `world` ranks."""
    if world <= 1:
        return 0.0
    latency = SYMM_WAIT_S if op == "symm_" else 0.0 if op == "symm_read" else ALLREDUCE_LATENCY_S
    return latency + moved_bytes(op, payload, world) / gpu.nvlink_bytes_per_s


# the architectures whose products in the checkpoint's formats take the e4m3 MMA in programs of 8 rows, 32 in
# a long call (kernels/_triton.py E4M3_MMA_ROWS, E4M3_LONG_ROWS); their issue figures are per such pass
E4M3_ARCHS = (89, 90)


def runs_long(la: dict, gpu: GPU, long: bool) -> bool:
    """Whether a counted launch's products run as a long call's on `gpu` (`long`: the count is a prefill
    chunk's; the launch declared its long FLOPs, count.py; from registers on every GPU, in the checkpoint's
    formats where the long loop was measured: sm_90's e4m3 MMA, sm_100/103's block-scaled MMA)."""
    return (long and "products_long" in la["flops"]
            and (la["path"] == "registers" or gpu.arch in ISSUE_PER_ELEMENT_LONG))


def issue_table(la: dict, long: bool) -> dict:
    """The issue per weight element that prices a launch's products: by their path and whether they run as a
    long call's; the native tables where a format is not measured from registers."""
    native = ISSUE_PER_ELEMENT_LONG if long else ISSUE_PER_ELEMENT
    if la["path"] != "registers":
        return native
    registers = ISSUE_PER_ELEMENT_REGISTERS_LONG if long else ISSUE_PER_ELEMENT_REGISTERS
    return {arch: {**ISSUE_PER_ELEMENT.get(arch, {}), **measured} for arch, measured in registers.items()}


def launch_terms(la: dict, gpu: GPU, routed_scale: float = 1.0, long: bool = False) -> dict:
    """What bounds one counted launch (count.py's `launches`), in seconds: its bytes from HBM, the
    instructions its weight products issue (one pass of the main loop per 16 rows, per 8 on the e4m3 MMA in
    the checkpoint's formats; where it `runs_long`, per LONG_ROWS, or E4M3_LONG_ROWS on the e4m3 MMA in the
    checkpoint's formats), their tensor FLOPs and the attention's and its reads over the host link; the
    routed experts' part scaled by `routed_scale` (a busier rank than the mean)."""
    extra = routed_scale - 1.0
    hbm = la["bytes_read"] + la["bytes_written"] - la["host_bytes"] + extra * la["routed_bytes"]
    counted = sum(la["weights"].values())
    weights = {f: n + extra * la["routed_weights"].get(f, 0) for f, n in la["weights"].items()}
    family = WEIGHT_KERNELS.get(la["name"])
    # the products' passes over their weights: their declared FLOPs over one pass's (16 rows, or a long
    # call's LONG_ROWS); one if the count declared none
    runs = runs_long(la, gpu, long)
    tile, kind, table = (LONG_ROWS, "products_long", issue_table(la, True)) if runs else (
        MMA_ROWS, "products", issue_table(la, False))
    if la["path"] == "native" and gpu.arch in E4M3_ARCHS:  # the e4m3 MMA's programs of 8 rows, long 32
        e4m3 = (E4M3_LONG_ROWS, "products_long_e4m3") if runs else (E4M3_MMA_ROWS, "products_e4m3")
        if e4m3[1] in la["flops"]:
            tile, kind = e4m3
    declared = la["flops"].get(kind, 0)
    passes = declared / (2 * tile * counted) if declared and counted else 1.0
    per_element = table.get(gpu.arch, {})
    issue = passes * sum(n * per_element.get((family, f), 0.0) for f, n in weights.items()) if family else 0.0
    products = 2 * tile * passes * sum(weights.values()) if family else 0.0
    attention = la["flops"].get("attention", 0)
    tensor = 0.0
    if gpu.tensor_flops:  # products in the checkpoint's formats on the FP8 path on every architecture here,
        # from registers on bfloat16 (module docstring), the attention's and the indexer's dots on bfloat16
        rate = gpu.tensor_flops["bf16" if la["path"] == "registers" else "fp8"]
        tensor = products / rate + (attention / gpu.tensor_flops["bf16"] if attention else 0.0)
    return {"bytes": hbm / (gpu.hbm_bytes_per_s * COPY_FRACTION),
            "issue": issue / gpu.issue_per_s if gpu.issue_per_s else 0.0,
            "tensor": tensor,
            "host_link": HOST_READ_LATENCY_S + la["host_bytes"] / gpu.host_link_bytes_per_s if la["host_bytes"]
            else 0.0}


def busiest_share(experts: int, top_k: int, rows: int, world: int, routing: list | None = None,
                  trials: int = 4000) -> float:
    """Distinct selected experts on the rank holding the most of them over the mean per rank, for a call of
    `rows` rows choosing `top_k` of `experts` each, the experts split in `world` contiguous ranges. From
    `routing` (calls of that many rows as measured: lists of rows' expert ids) when it has any; else uniform
    routing, a fixed-seed simulation of `trials` calls."""
    if world <= 1:
        return 1.0
    calls = [c for c in routing or () if len(c) == rows]
    if calls:
        picked = torch.zeros(len(calls), experts, dtype=torch.bool)
        for i, c in enumerate(calls):
            picked[i, torch.tensor([e for row in c for e in row])] = True
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.rand(trials, rows, experts, generator=g).topk(top_k, dim=-1).indices.flatten(1)
        picked = torch.zeros(trials, experts, dtype=torch.bool).scatter_(1, ids, True)
    per_rank = torch.stack([part.sum(-1) for part in picked.tensor_split(world, dim=1)], -1).double()
    return (per_rank.max(-1).values.mean() / per_rank.mean()).item()


def busier_rank_s(la: dict, gpu: GPU, world: int, routing: list | None, shares: dict, long: bool = False) -> float:
    """What an MoE launch costs the rank holding the most of its call's selected whole experts beyond the
    mean rank (seconds); `shares` caches busiest_share by (experts, top-k, rows)."""
    key = tuple(la["routing"])
    if key not in shares:
        shares[key] = busiest_share(*key, world, routing)
    return (max(launch_terms(la, gpu, shares[key], long).values())
            - max(launch_terms(la, gpu, long=long).values()))


def launch_s(kind: str, gpu: GPU) -> float:
    """The fixed cost of a launch of `kind` (a counted launch's "kind": "triton" or "torch"): LAUNCH_PDL_S for
    a Triton kernel on a GPU that launches them dependent (sm_90 and later), LAUNCH_S otherwise."""
    return LAUNCH_PDL_S if kind == "triton" and gpu.arch >= 90 else LAUNCH_S


def cycle_time(count: dict, gpu: GPU, world: int, routing: list | None = None) -> dict:
    """One cycle (seconds) from a count (count.count_cycle): every launch at what bounds it plus its fixed cost
    (`launch_s`),
    the busiest rank's extra expert reads (`imbalance`), the collectives. Terms: each launch's time goes to
    its bound (bytes, issue, tensor, host_link), its fixed cost to `launches`. A prefill chunk's count
    (`long_calls`) prices the products that `runs_long` as a long call's, each with the launch staging its
    rows (kernels.rows._stage_kernel: its bytes and a Triton launch's fixed cost)."""
    long = count.get("long_calls", False)
    terms = dict.fromkeys(("bytes", "issue", "tensor", "host_link"), 0.0)
    kernels: dict[str, dict] = defaultdict(lambda: {"launches": 0, "bytes": 0, "written": 0, "weights": 0, "s": 0.0,
                                                     "by_bound": defaultdict(float), "issue_priced": False})
    imbalance, shares, stagings, fixed = 0.0, {}, 0, 0.0
    triton_fixed = launch_s("triton", gpu)
    for la in count["launches"]:
        t = launch_terms(la, gpu, long=long)
        if runs_long(la, gpu, long) and la["staged_bytes"]:
            stagings += 1
            fixed += triton_fixed
            staging = kernels["kernels.rows._stage_kernel"]
            staging["launches"] += 1
            staging["bytes"] += la["staged_bytes"]
            s = la["staged_bytes"] / (gpu.hbm_bytes_per_s * COPY_FRACTION)
            staging["s"] += s + triton_fixed
            staging["by_bound"]["bytes"] += s
            terms["bytes"] += s
        bound = max(t, key=t.get)
        terms[bound] += t[bound]
        k = kernels[la["name"]]
        k["launches"] += 1
        k["bytes"] += la["bytes_read"]
        k["written"] += la["bytes_written"]
        k["weights"] += sum(la["weights"].values())
        own = launch_s(la["kind"], gpu) + la["phase_waits"] * PHASE_WAIT_S
        fixed += own
        k["s"] += t[bound] + own
        k["by_bound"][bound] += t[bound]
        k["issue_priced"] |= la["name"] in WEIGHT_KERNELS and gpu.issue_per_s > 0
        if la["whole_experts"] and world > 1:
            imbalance += busier_rank_s(la, gpu, world, routing, shares, long)
    terms["launches"] = fixed
    terms["imbalance"] = imbalance
    terms["collectives"] = sum(c["count"] * collective_s(c["op"], c["bytes"], world, gpu)
                               for c in count["collectives"]["payloads"])
    table = sorted(({"kernel": name, **dict(k, by_bound=dict(k["by_bound"]),
                                             bound=max(k["by_bound"], key=k["by_bound"].get))}
                    for name, k in kernels.items()), key=lambda k: -k["s"])
    total = sum(terms.values())
    return {"terms_s": terms, "cycle_s": total, "dominant": max(terms, key=terms.get), "stagings": stagings,
            "bytes": count["bytes_per_step"]["total"], "kernels": table,
            "busiest_rank_share": {f"{e} experts, top-{k}, {r} rows": v for (e, k, r), v in shares.items()}}


def placement(count: dict, gpu: GPU, world: int, dim: int, routing: list | None = None) -> dict:
    """Where the routed experts cost least, priced on the counted cycle (seconds a cycle of what differs
    between the placements): `expert_parallel` (each rank holds a quarter of the experts whole): the busiest
    rank's extra reads (the imbalance term) and each MoE call's sum over ranks, which both placements send the
    same: each row's routed pairs summed on its rank and the shared expert's partial row (rows x 2 x dim
    float32, kernels/moe.py `_row_sums_into`); `split_intermediate` (every expert split by its intermediate
    dimension over the ranks, parallel/sharding.py): no imbalance, the same sum."""
    if world <= 1:
        return {}
    shares: dict = {}
    # the sums over ranks as the count takes them: over symmetric memory, or gathered
    sums = "symm_" if any(c["op"] == "symm_" for c in count["collectives"]["payloads"]) else "allgather_"
    experts = dict.fromkeys(("expert_parallel", "split_intermediate"), 0.0)
    for la in count["launches"]:
        if la["routing"] is not None:
            experts["expert_parallel"] += busier_rank_s(la, gpu, world, routing, shares)
            # one sum over ranks per MoE call: at its gate and up's launch (a decode step's one launch)
            if "gate_up" in la["name"] or "moe._step_kernel" in la["name"]:
                sent = collective_s(sums, la["routing"][2] * 2 * dim * 4, world, gpu)
                experts["expert_parallel"] += sent
                experts["split_intermediate"] += sent
    return {"routed_experts": dict(experts, cheaper=min(experts, key=experts.get))}


def bytes_bound_cycle(count: dict, gpu: GPU, world: int, nbytes: float, fixed: float) -> dict:
    """A reference cycle as if every kernel were bound by its bytes: `nbytes` at the copy bandwidth, `fixed`
    seconds of launches' fixed costs, the counted host-link reads and collectives."""
    host = count["host_link"]
    terms = {"bytes": (nbytes - host["bytes_per_cycle"]) / (gpu.hbm_bytes_per_s * COPY_FRACTION),
             "host_link": host["launches_per_cycle"] * HOST_READ_LATENCY_S
             + host["bytes_per_cycle"] / gpu.host_link_bytes_per_s,
             "launches": fixed,
             "collectives": sum(c["count"] * collective_s(c["op"], c["bytes"], world, gpu)
                                for c in count["collectives"]["payloads"])}
    total = sum(terms.values())
    return {"terms_s": terms, "cycle_s": total, "dominant": max(terms, key=terms.get), "bytes": nbytes}


def constants(gpu: GPU) -> dict:
    return {"gpu": asdict(gpu), "copy_fraction": COPY_FRACTION,
            "copy_bytes_per_s": gpu.hbm_bytes_per_s * COPY_FRACTION, "launch_s": LAUNCH_S,
            "triton_launch_s": launch_s("triton", gpu), "phase_wait_s": PHASE_WAIT_S,
            "allreduce_latency_s": ALLREDUCE_LATENCY_S, "symm_wait_s": SYMM_WAIT_S,
            "host_read_latency_s": HOST_READ_LATENCY_S,
            "host_link": HOST_LINK, "issue_per_element": {f"{k} {f}": v for (k, f), v in
                                                          ISSUE_PER_ELEMENT.get(gpu.arch, {}).items()}}


def load_routing(path, experts: int) -> list:
    """Measured routing for `--routing FILE`: JSON lines, one MoE call each, its rows' selected expert ids
    ([[ids of row 0], [ids of row 1], ...], each id below `experts`). ValueError naming the line otherwise."""
    calls = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                call = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {n}: not JSON ({e.msg})") from None
            if not (isinstance(call, list) and call and all(
                    isinstance(row, list) and row and all(type(e) is int and 0 <= e < experts for e in row)
                    for row in call)):
                raise ValueError(f"line {n}: not a list of rows of expert ids in 0..{experts - 1}")
            calls.append(call)
    return calls


def prefill(first: dict, last: dict, gpu: GPU, world: int, prompts: list[int]) -> dict:
    """Time to first token for prompts of `prompts` positions, from two counted chunks (count.count_prefill)
    at the start and near the end of the longest: each priced as a cycle (`cycle_time`), a chunk's time
    taken as linear in its start between them (what grows with the context is linear in it: the index keys
    scored, the compressed rows read and gathered), summed over a prompt's chunks (the last one whole)."""
    chunk = first["chunk"]
    t0, t1 = (cycle_time(c, gpu, world) for c in (first, last))
    slope = (t1["cycle_s"] - t0["cycle_s"]) / max(last["start"] - first["start"], 1)
    out = []
    for n_tokens in prompts:
        n = -(-n_tokens // chunk)
        ttft = n * t0["cycle_s"] + slope * chunk * n * (n - 1) / 2
        last_s = t0["cycle_s"] + slope * chunk * (n - 1)
        out.append({"prompt": n_tokens, "chunks": n, "ttft_s": ttft, "tokens_per_s": n_tokens / ttft,
                    "last_chunk_s": last_s, "last_chunk_tokens_per_s": chunk / last_s})
    chunks = {}
    for c, t in ((first, t0), (last, t1)):
        chunks[c["start"]] = {
            "chunk_s": t["cycle_s"], "terms_s": t["terms_s"], "dominant": t["dominant"],
            "launches": c["launches_per_chunk"] + t["stagings"], "launches_per_layer": c["launches_per_layer"],
            "scratch_bytes": c["scratch_bytes"],
            "collectives": c["collectives"]["per_cycle"], "bytes_read": c["bytes_per_step"]["total"],
            "bytes_written": c["bytes_per_step"]["written"],
            "link_bytes_sent": sum(p["count"] * moved_bytes(p["op"], p["bytes"], world)
                                   for p in c["collectives"]["payloads"]),
            "flops": c["flops"], "kernels": t["kernels"]}
    return {"chunk": chunk, "chunks": chunks, "prompts": out}


def dispatch_floor_bytes(cfg, rows: int, world: int) -> float:
    """The least a rank sends over the links in a prefill chunk of `rows` tokens while the ranks hold the
    routed experts in `world` equal parts (the checkpoint's experts are far too large to move or replicate):
    every token's row goes out to each other rank holding one of its experts and that rank's output comes
    back. Rows out in FP8 with a scale a block (the products quantize them so anyway), outputs back in
    bfloat16 (one per token and rank: its experts there summed first); a token's home on a rank that holds
    one of its experts, so E[distinct ranks of its experts] - 1 go out, uniform routing (the ranks' shares
    drawn without replacement). A floor: nothing else that crosses (keys for attention by query rows, the
    shared expert, the head) is counted."""
    if world <= 1:
        return 0.0
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    missed = math.prod((e - e // world - i) / (e - i) for i in range(k))  # a rank holds none of a token's k
    remote = world * (1.0 - missed) - 1.0
    row = cfg.dim * (1.0 + 4.0 / cfg.act_block) + cfg.dim * 2.0
    return rows / world * remote * row * cfg.n_layers


def against_anchors(prediction: dict) -> dict:
    """The counted cycle beside the anchors: tokens/s over vLLM's P90 and SGLang's DSpark TPOT over ms a
    token (above 1: faster than they)."""
    c = prediction["counted"]
    return {"tokens_per_s": c["tokens_per_s"], "ms_per_token": c["ms_per_token"],
            "vs_vllm_p90": c["tokens_per_s"] / ANCHORS["vllm_p90_tokens_per_s"],
            "vs_sglang_dspark_tpot": ANCHORS["sglang_dspark_tpot_ms"] / c["ms_per_token"]}


def predict(count: dict, gpu: GPU, world: int, tokens_per_cycle: float, routing: list | None = None) -> dict:
    """The cycle as counted (`cycle_time`), and two references as if every kernel were bound by its bytes: at
    the ideal bytes, and at the ideal bytes with the launch budget of DESIGN.md (16 per layer plain, 20 per
    layer for a verify, 16 per draft stage; the launches outside layers and stages as counted)."""
    counted = cycle_time(count, gpu, world, routing)
    ideal = count["bytes_per_step"]["ideal"]
    at_ideal = bytes_bound_cycle(count, gpu, world, ideal, counted["terms_s"]["launches"])
    layers = len(count["launches_by_layer"])
    budget = 16 if count["width"] == 1 else 20
    outside = sum(launch_s(la["kind"], gpu) for la in count["launches"] if la["block"] == "outside")
    kernels = budget * layers + 16 * count.get("draft_stage_calls", 0)  # Triton kernels, the budget's
    at_budget = bytes_bound_cycle(count, gpu, world, ideal, kernels * launch_s("triton", gpu) + outside)
    out = {}
    for name, c in (("counted", counted), ("ideal_bytes", at_ideal), ("ideal_bytes_and_launch_budget", at_budget)):
        out[name] = dict(c, tokens_per_cycle=tokens_per_cycle, tokens_per_s=tokens_per_cycle / c["cycle_s"],
                         ms_per_token=c["cycle_s"] * 1e3 / tokens_per_cycle)
    return out
