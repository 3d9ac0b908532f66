"""What every block needs besides its weights: the numerics, the op registry and the device, and how a
`--devices` value and the run options turn into them."""

import os
from dataclasses import dataclass, field

import torch

from appliance.errors import ModelLoadError
from kernels.registry import Ops, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Numerics:
    """`official`: the official code's FP8/FP4 activation and KV quantization emulation and its fp32
    islands; otherwise `plain` (dequantized weights, no quantization emulation: transformers' arithmetic
    for V4, what a bf16 engine computes for V4.1). `dtype`: the activation dtype every rounding point
    rounds to (float32 reproduces the official float32 reference runs)."""

    official: bool = True
    dtype: torch.dtype = torch.float32


@dataclass
class Runtime:
    """What every block needs besides its weights: numerics, the op registry, the device."""

    num: Numerics
    ops: Ops
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def dtype(self) -> torch.dtype:
        return self.num.dtype

    @property
    def wide(self) -> torch.dtype:
        """Where the model's own torch arithmetic widens past the activation dtype (a Hadamard butterfly, a
        pooling softmax, a sum of two rounded inputs): float64 on the reference path (the oracle), float32 on
        the fast path (its numerics allow no float64: within the fast path's stated tolerance)."""
        return torch.float64 if self.ops.path == "reference" else torch.float32



def parse_device(devices: str) -> torch.device:
    """One process's device from a --devices value: "cpu", "cuda", "cuda:1", or "0" (= cuda:0). (Several
    devices, "cpu:4" or "0,1,2,3", need a process group: appliance.parallel.world.start.)"""
    d = devices.split(",")[0].strip()
    if d.isdigit():
        d = f"cuda:{d}"
    if d.startswith("cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"--devices {devices}: CUDA is not available on this machine (use cpu)", field="devices")
    return torch.device(d)


def make_runtime(numerics: str = "official", dtype: str = "float32", path: str = "auto",
                 device: str = "cpu") -> Runtime:
    """`path` auto: the Triton kernels on CUDA, the torch references on CPU."""
    dev = parse_device(device)
    if path == "auto":
        path = "fast" if dev.type == "cuda" else "reference"
    if numerics not in ("official", "plain"):
        raise ModelLoadError(f"numerics {numerics!r}: must be official or plain", field="numerics")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r}: must be one of {', '.join(DTYPES)}", field="dtype")
    return Runtime(Numerics(numerics == "official", DTYPES[dtype]), resolve(path), dev)


def set_cpu_threads(dim: int) -> int:
    """Intra-op threads for the CPU path. Decode is hundreds of tiny ops per token: for small models (hidden
    size `dim`) one thread is fastest, and more threads spin against each other (and against anything else
    on the box), which made a tiny model 10x slower on a loaded 2-core machine. APPLIANCE_THREADS overrides."""
    n = int(os.environ.get("APPLIANCE_THREADS", 0)) or (1 if dim <= 2048 else os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n
