"""A cost model of one decode cycle on a named GPU (the library behind `appliance bench model`): the counted
launches, bytes and collectives of a cycle (count.py, on a meta build of the config when the weights are
absent) turned into a cycle time and tokens/s.

Assumptions (each constant below names its source):
- The cycle is one captured CUDA graph per rank; its kernels run back to back on one stream. Each pays a
  fixed cost (`LAUNCH_S`: the gap from one kernel's end to the next one's full occupancy, with its ramp and
  tail) plus its bytes at the effective bandwidth. Nothing overlaps: no kernel hides another's latency,
  and collectives are not overlapped with compute. So the terms add:
      cycle = bytes / (HBM x COPY_FRACTION x KERNEL_FRACTION) + launches x LAUNCH_S + sum of collectives
- Decode is bound by memory: arithmetic is not a term (one to six rows per weight read; every GPU named
  here has over 100 FLOP/byte of bf16/fp8 tensor throughput, and the kernels' fp32 accumulation does not
  use float64). A kernel whose arithmetic is not hidden (FP64 on a B300) is outside this model.
- Bytes are what the cycle's kernels read, counted (not the ideal); writes are small next to reads in
  decode and are not counted. The bytes read from host memory (the Engram rows the lookup copies, ~12.7 KB
  per token on V4.1-Flash) are priced over the host link instead: each launch that reads host memory waits
  one round trip (`HOST_READ_LATENCY_S`; its loads are issued together, none depends on another host load)
  plus its bytes at the link's bandwidth.
- A collective costs `ALLREDUCE_LATENCY_S` plus its payload over NVLink at ring efficiency
  (all-reduce: 2 (N-1)/N of the payload per rank; all-gather: (N-1) x the rank's part).
- Ranks are symmetric (experts and heads split evenly, routing uniform on average): the cycle of rank 0 is
  the box's cycle.
Tokens per cycle: 1 without drafting; with k drafts and a mean of A accepted drafts per cycle, A + 1 (the
accepted drafts and the token the verify adds; `speculative.mean_accepted` in this project's reports).
"""

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float  # datasheet peak
    memory_bytes: float
    nvlink_bytes_per_s: float  # per GPU, one direction
    source: str
    host_link_bytes_per_s: float = 50e9  # the device reading host memory: PCIe Gen5 x16 (see HOST_LINK)


GPUS = {
    "b300": GPU("NVIDIA B300 (Blackwell Ultra, SXM)", 8.0e12, 288e9, 900e9,
                "NVIDIA HGX B300 datasheet: 288 GB HBM3e at 8 TB/s per GPU; NVLink 5 at 1.8 TB/s per GPU "
                "(both directions)"),
    "b200": GPU("NVIDIA B200 (SXM)", 8.0e12, 180e9, 900e9,
                "NVIDIA HGX B200 datasheet: 180 GB HBM3e at 8 TB/s per GPU; NVLink 5 at 1.8 TB/s per GPU"),
    "h200": GPU("NVIDIA H200 (SXM)", 4.8e12, 141e9, 450e9,
                "NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s; NVLink 4 at 900 GB/s per GPU"),
    "h100": GPU("NVIDIA H100 (SXM)", 3.35e12, 80e9, 450e9,
                "NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s per GPU"),
}

# A device-to-device copy moved 4.3 TB/s (read + write) on an H200 of the device machines here, 0.9 of the
# 4.8 TB/s datasheet figure (/work/.library/device/KINDS.md, 2026-10-28); assumed the same on every GPU.
COPY_FRACTION = 0.90
# The fraction of the copy bandwidth a decode kernel reaches: issue 13's goal for each kernel at M = 1.
KERNEL_FRACTION = 0.80
# Per kernel inside a captured graph: the lower end of issue 13's estimate (10-25 ms of launch latency for
# ~4,560 launches: 2.2-5.5 us each), rounded down; `scripts/device-check.sh` measures it (`launch_us`).
LAUNCH_S = 2.0e-6
# The device's reads of host memory (zero-copy loads of registered pages) on an HGX board: PCIe Gen5 x16 to
# the host, 64 GB/s per direction raw, taken as 50 GB/s after protocol overhead (a pinned host-to-device copy
# reaches about that); a round trip of about 1.5 us per dependent load. Both are assumptions until
# `appliance bench kernels` on the device (its "engram lookup, host tables" row) measures them.
HOST_LINK = "PCIe Gen5 x16, 50 GB/s, 1.5 us a round trip (assumed; bench kernels measures the lookup)"
HOST_READ_LATENCY_S = 1.5e-6
# NCCL all-reduce of a small payload inside a CUDA graph on one NVLink node: about 6 us measured on 2 x
# H100 with NVLSTree and graphs (NVIDIA/nccl issue #1259); taken for 4 GPUs of any of these generations.
ALLREDUCE_LATENCY_S = 6.0e-6


def collective_s(op: str, payload: int, world: int, gpu: GPU) -> float:
    """Seconds for one collective of `payload` bytes (this rank's input) over `world` ranks."""
    if world <= 1:
        return 0.0
    moved = payload * 2 * (world - 1) / world if "reduce" in op else payload * (world - 1)
    return ALLREDUCE_LATENCY_S + moved / gpu.nvlink_bytes_per_s


def cycle_time(count: dict, gpu: GPU, world: int, bytes_key: str = "total") -> dict:
    """The terms of one cycle (seconds) from a count (count.count_cycle)."""
    bw = gpu.hbm_bytes_per_s * COPY_FRACTION * KERNEL_FRACTION
    nbytes = count["bytes_per_step"][bytes_key]
    host = count["host_link"]
    terms = {
        "bytes": (nbytes - host["bytes_per_cycle"]) / bw,
        "launches": count["launches_per_cycle"] * LAUNCH_S,
        "collectives": sum(c["count"] * collective_s(c["op"], c["bytes"], world, gpu)
                           for c in count["collectives"]["payloads"]),
        "host_link": host["launches_per_cycle"] * HOST_READ_LATENCY_S
        + host["bytes_per_cycle"] / gpu.host_link_bytes_per_s,
    }
    total = sum(terms.values())
    return {"terms_s": terms, "cycle_s": total, "dominant": max(terms, key=terms.get), "bytes": nbytes}


def constants(gpu: GPU) -> dict:
    return {"gpu": asdict(gpu), "copy_fraction": COPY_FRACTION, "kernel_fraction": KERNEL_FRACTION,
            "effective_bytes_per_s": gpu.hbm_bytes_per_s * COPY_FRACTION * KERNEL_FRACTION,
            "launch_s": LAUNCH_S, "allreduce_latency_s": ALLREDUCE_LATENCY_S,
            "host_read_latency_s": HOST_READ_LATENCY_S, "host_link": HOST_LINK}


def predict(count: dict, gpu: GPU, world: int, tokens_per_cycle: float) -> dict:
    """The cycle as counted, and two references: at the ideal bytes, and at the ideal bytes with the
    launch budget of DESIGN.md and issue 13 (16 per layer plain, 20 per layer for a verify, 16 per draft
    stage; the launches outside layers and stages as counted)."""
    counted = cycle_time(count, gpu, world)
    at_ideal = cycle_time(count, gpu, world, "ideal")
    layers = len(count["launches_by_layer"])
    budget = 16 if count["width"] == 1 else 20
    launches = budget * layers + 16 * count.get("draft_stage_calls", 0) + count["launches_outside_layers"]
    budgeted = dict(count, launches_per_cycle=launches)
    at_budget = cycle_time(budgeted, gpu, world, "ideal")
    out = {}
    for name, c in (("counted", counted), ("ideal_bytes", at_ideal), ("ideal_bytes_and_launch_budget", at_budget)):
        out[name] = dict(c, tokens_per_cycle=tokens_per_cycle, tokens_per_s=tokens_per_cycle / c["cycle_s"],
                         ms_per_token=c["cycle_s"] * 1e3 / tokens_per_cycle)
    return out
