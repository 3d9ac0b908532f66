"""Load a model directory: config, tokenizer, checkpoint, the backbone and its drafter, on the reference
or fast op path, split over ranks and placed on the device. Every problem with the directory surfaces here
as a ModelLoadError naming the file; what the load learned that stops a CUDA-graph capture is published in
`LoadedModel.capture_blockers`."""

from dataclasses import dataclass, field
from pathlib import Path

from appliance.model.config import ModelConfig, V41Config, load_config
from appliance.model.engram import build_token_map
from appliance.model.families import build_drafter, build_model
from appliance.model.runtime import Runtime, make_runtime, set_cpu_threads
from appliance.model.tokenizer import load_tokenizer
from appliance.model.weights import Checkpoint
from appliance.parallel.placement import map_to_device, place
from appliance.parallel.sharding import largest_sum, shard, verify_rows

from .options import RunOptions


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
    # why the decode cycle cannot be captured in CUDA graphs, as the load found it (empty: it can)
    capture_blockers: list[str] = field(default_factory=list)


def default_model_dir() -> Path:
    """The tiny V4.1 checkpoint shipped inside the package (`appliance serve` without --model)."""
    return Path(__file__).parent / "default_model"


def load_model(options: RunOptions, notice=print, world=None) -> LoadedModel:
    """Load `options.model_dir` (its drafter too when `options.draft` is not none) on `options.devices`.
    `world` (appliance.parallel.world.World): several ranks: this process keeps its shard of the model."""
    model_dir = options.model_dir or default_model_dir()
    cfg = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ckpt = Checkpoint(model_dir)
    device = world.device if world is not None and world.distributed else options.devices
    rt = make_runtime(options.numerics, options.dtype, options.path, device)
    if rt.device.type == "cpu":
        set_cpu_threads(cfg.dim)
    token_map = None
    if isinstance(cfg, V41Config):
        if cfg.engram is not None:
            token_map = build_token_map(model_dir / "tokenizer.json", cfg.engram.compressed_vocab_size)
        if cfg.has_vision and notice:
            notice(f"{model_dir}: vision_config present; this server is text only (image tokens are rejected)")
    model = build_model(cfg, ckpt, rt, token_map)
    ignore = [r"^mtp\.\d+\.(embed|head)\.weight$"]  # exporters' duplicates of the backbone's
    if not options.load_drafter:
        ignore.append(r"^mtp\.")
    if getattr(cfg, "has_vision", False):
        ignore += [r"^vision\.", r"^aligner\.", r"^image_(start|end|newline)$", r"\.gate\.bias_vl$"]
    drafter = build_drafter(cfg, ckpt, rt, model) if options.load_drafter else None
    ckpt.finish(tuple(ignore))
    blockers = []
    if rt.ops.path == "reference":
        blockers.append("the reference ops read values on the host (the MoE's selected experts); use --path fast")
    if world is not None and world.distributed:
        if options.check_ranks:
            world.check_calls()
        capacity = largest_sum(cfg, verify_rows(cfg, options.load_drafter), options.context or cfg.max_context)
        blockers += shard(model, drafter, world.comm(options.allreduce, capacity), options.experts)
    if rt.device.type != "cpu":
        kept: list[tuple[str, object]] = []
        place((model, drafter), rt.device, kept=kept)
        for _, table in kept:  # the lookup kernel reads host tables in place; the reference gathers on the host
            if rt.ops.path == "fast":
                map_to_device(table)
    return LoadedModel(cfg, model, tokenizer, ckpt, rt, model_dir, drafter, world, blockers)
