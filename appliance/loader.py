"""Load a model directory: config, tokenizer, checkpoint, the backbone and its drafter, on the reference
or fast op path. Every problem with the directory surfaces here as a ModelLoadError naming the file."""

from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.model.blocks import Numerics, Runtime
from appliance.model.config import ModelConfig, V41Config, load_config
from appliance.model.tokenizer import load_tokenizer
from appliance.model.weights import Checkpoint
from kernels.registry import resolve

from .errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: object  # V4Model | V41Model
    tokenizer: object
    checkpoint: Checkpoint
    runtime: Runtime
    model_dir: Path
    drafter: object = None  # DSpark or MTP drafter when loaded
    world: object = None  # appliance.parallel.world.World when the model is split over ranks


def default_model_dir() -> Path:
    """The tiny V4.1 checkpoint shipped inside the package (`appliance serve` without --model)."""
    return Path(__file__).parent / "default_model"


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


def set_cpu_threads(cfg: ModelConfig) -> int:
    """Intra-op threads for the CPU path. Decode is hundreds of tiny ops per token: for small models one
    thread is fastest, and more threads spin against each other (and against anything else on the box),
    which made a tiny model 10x slower on a loaded 2-core machine. APPLIANCE_THREADS overrides."""
    import os

    n = int(os.environ.get("APPLIANCE_THREADS", 0)) or (1 if cfg.dim <= 2048 else os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


def load_model(model_dir=None, numerics: str = "official", dtype: str = "float32", path: str = "auto",
               device: str = "cpu", notice=print, load_drafter: bool = False, world=None) -> LoadedModel:
    """`world` (appliance.parallel.world.World): several ranks: this process keeps its shard of the model."""
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    cfg = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ckpt = Checkpoint(model_dir)
    if world is not None and world.distributed:
        device = world.device
    rt = make_runtime(numerics, dtype, path, device)
    if rt.device.type == "cpu":
        set_cpu_threads(cfg)
    if isinstance(cfg, V41Config):
        from appliance.model.deepseek_v41 import V41Model

        token_map = None
        if cfg.engram is not None:
            from appliance.model.engram import build_token_map

            token_map = build_token_map(model_dir / "tokenizer.json", cfg.engram.compressed_vocab_size)
        if cfg.has_vision and notice:
            notice(f"{model_dir}: vision_config present; this server is text only (image tokens are rejected)")
        model = V41Model(cfg, ckpt, rt, token_map)
    else:
        from appliance.model.deepseek_v4 import V4Model

        model = V4Model(cfg, ckpt, rt)
    ignore = [r"^mtp\.\d+\.(embed|head)\.weight$"]  # exporters' duplicates of the backbone's
    if not load_drafter:
        ignore.append(r"^mtp\.")
    if getattr(cfg, "has_vision", False):
        ignore += [r"^vision\.", r"^aligner\.", r"^image_(start|end|newline)$", r"\.gate\.bias_vl$"]
    drafter = None
    if load_drafter:
        from appliance.model.drafters import load_drafter as build_drafter

        drafter = build_drafter(cfg, ckpt, rt, model)
    ckpt.finish(tuple(ignore))
    if world is not None and world.distributed:
        from appliance.parallel.sharding import shard

        shard(model, drafter, world.comm())
    if rt.device.type != "cpu":
        from appliance.parallel.placement import place

        place((model, drafter), rt.device)
    return LoadedModel(cfg, model, tokenizer, ckpt, rt, model_dir, drafter, world)
