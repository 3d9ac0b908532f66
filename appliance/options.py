"""How a model runs: one frozen object built once (by the CLI's `run_options` decorator, from flags or
APPLIANCE_* environment variables) and handed to `Engine.load`, the loader and the decode session. No torch
here: the server and the CLI's help read it without loading anything."""

from dataclasses import dataclass, fields
from pathlib import Path

from .errors import ApplianceError

DRAFTS = ("none", "dspark", "mtp", "adaptive", "auto")
NUMERICS = ("official", "plain")
DTYPES = ("float32", "bfloat16")
PATHS = ("auto", "reference", "fast")
INDEX_KEYS = ("own", "reference")
ALLREDUCE = ("auto", "nccl", "symm")
EXPERTS = ("auto", "split", "whole")
# The most rows one forward may take: the kernels' largest launch (kernels/_triton.py MAX_ROWS; a test checks
# the two agree). A prefill chunk is one forward.
MAX_CHUNK = 8192


@dataclass(frozen=True)
class RunOptions:
    """Everything about how one model runs. Defaults: the embedded tiny model on the CPU, no drafting."""

    model_dir: Path | None = None  # None: the embedded tiny DeepSeek-V4.1 checkpoint
    devices: str = "cpu"  # cpu | cuda | cuda:N | N | cpu:4 | 0,1,2,3 (several: one process per device)
    numerics: str = "official"  # official: the official FP8/FP4 quantization emulation; plain: without it
    dtype: str = "float32"  # the activation dtype every rounding point rounds to
    path: str = "auto"  # reference | fast | auto (fast on CUDA, reference on CPU)
    index_keys: str = "own"  # V4.1: own | reference (the released decode-time publication order)
    draft: str = "none"  # speculative drafting, one of DRAFTS (auto: the checkpoint's own drafter)
    draft_tokens: int = 3  # drafts per cycle
    # prefill chunk: cancel and progress act between chunks. The most rows one forward takes: on 4 x B300 an
    # 8192-token chunk is modeled at 0.07-0.10 s, 855K in 8.9 s against 10.4 s in chunks of 4096 (an expert's
    # 128 pairs about fill one tile) and its scratch, 1.9 GB a rank at 855K, fits an H200 (BENCHMARKS.md)
    chunk: int = MAX_CHUNK
    context: int | None = None  # context limit in tokens; None: the model's, capped by memory
    graphs: bool = True  # on CUDA, replay the decode cycle as captured CUDA graphs
    allreduce: str = "auto"  # several devices: how partial sums meet (appliance/parallel/collectives.py)
    check_ranks: bool = False  # several devices: compare every collective's call and every job's end state
    experts: str = "auto"  # several devices: how the MoE's experts are placed, one of EXPERTS (parallel/sharding.py)
    checkpoint_stride: int = 2048  # positions between state checkpoints (0: none; rewinds within 16 only)
    prefix_cache_gb: float = 8.0  # host memory for cached conversations (0: keep only the live state)
    prefix_cache_dir: Path | None = None  # the disk tier: cached conversations that survive a restart
    prefix_cache_disk_gb: float = 64.0  # the disk tier's budget

    def __post_init__(self):
        for name in ("model_dir", "prefix_cache_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        self.check()

    @property
    def load_drafter(self) -> bool:
        return self.draft != "none"

    def check(self) -> None:
        """Refuse what no run can use, naming the option (the CLI turns it into one line and exit 2)."""
        for name, allowed in (("draft", DRAFTS), ("numerics", NUMERICS), ("dtype", DTYPES), ("path", PATHS),
                              ("index_keys", INDEX_KEYS), ("allreduce", ALLREDUCE), ("experts", EXPERTS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ApplianceError(f"--{name.replace('_', '-')} {value!r}: must be one of {', '.join(allowed)}",
                                     field=name, value=value)
        _at_least("chunk", self.chunk, 1)
        if self.chunk > MAX_CHUNK:
            raise ApplianceError(f"--chunk {self.chunk}: must be at most {MAX_CHUNK} (the most rows one kernel "
                                 "launch takes)", field="chunk", value=self.chunk)
        _at_least("draft_tokens", self.draft_tokens, 1)
        if self.context is not None:
            _at_least("context", self.context, 2)
        _at_least("checkpoint_stride", self.checkpoint_stride, 0)
        for name in ("prefix_cache_gb", "prefix_cache_disk_gb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ApplianceError(f"--{name.replace('_', '-')} {value!r}: must be a number >= 0", field=name,
                                     value=value)

    def describe(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v) for f in fields(self)}


def _at_least(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ApplianceError(f"--{name.replace('_', '-')} {value!r}: must be an integer >= {low}", field=name,
                             value=value)
