"""What a model is and what it weighs, from its config alone: architecture, layer roles, weight bytes by
dtype and by where they live, and decode-state bytes per token of context (packed formats, as the
kernels store them, and as the reference path holds them)."""

from collections import defaultdict

from appliance.model.config import ModelConfig, V4Config, V41Config
from appliance.model.families import build_drafter, build_model
from appliance.model.runtime import make_runtime
from appliance.model.weights import ShapeCheckpoint


def inventory(cfg: ModelConfig) -> ShapeCheckpoint:
    """Every tensor the model (and its drafter) reads, by building it on a shape-only checkpoint."""
    ckpt = ShapeCheckpoint(cfg)
    rt = make_runtime("official", "float32", "reference")
    build_drafter(cfg, ckpt, rt, build_model(cfg, ckpt, rt))
    return ckpt


def where(name: str) -> str:
    """Engram tables stay memory-mapped in host memory; everything else is on the device."""
    return "host" if ".engram.embed." in name else "device"


def weight_bytes(cfg: ModelConfig) -> dict:
    ckpt = inventory(cfg)
    by_dtype: dict[str, int] = defaultdict(int)
    by_where: dict[str, int] = defaultdict(int)
    by_part: dict[str, int] = defaultdict(int)
    for name, (dtype, _) in ckpt.tensors.items():
        n = ckpt.nbytes(name)
        by_dtype[dtype] += n
        by_where[where(name)] += n
        by_part[_part(name)] += n
    return {"total": sum(by_dtype.values()), "by_dtype": dict(by_dtype), "by_where": dict(by_where),
            "by_part": dict(sorted(by_part.items(), key=lambda kv: -kv[1])), "tensors": len(ckpt.tensors)}


def _part(name: str) -> str:
    if name.startswith("mtp."):
        return "drafter"
    for key, part in ((".engram.", "engram"), (".experts.", "routed experts"), (".shared_experts.", "shared experts"),
                      (".attn.", "attention"), (".ffn.gate.", "router")):
        if key in name:
            return part
    if name.startswith(("embed.", "head.")):
        return "embed + head"
    return "norms + mHC"


def state_bytes(cfg: ModelConfig, spare: int = 16) -> dict:
    """Decode-state bytes: `per_token` grows with the context; `constant` is the rings and carries."""
    hd, r, ihd, w = cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, cfg.window_size
    per_token_packed = per_token_ref = 0.0
    constant_packed = constant_ref = 0
    n_rings = cfg.n_layers + (cfg.dspark.n_stages if cfg.dspark else (1 if cfg.n_mtp_layers else 0))
    if isinstance(cfg, V41Config):
        kv_row, index_row = hd // 2 + hd // 16, ihd // 2 + ihd // 32  # FP4 codes + e4m3 / E8M0 scales
        for s in cfg.kv_source_layers:
            m = cfg.compress_ratios[s]
            per_token_packed += (kv_row + index_row) / m
            per_token_ref += (hd + ihd) * 2 / m
            if m > 1:
                constant_ref += (m + spare) * 2 * hd * 4
        ring_row = hd + hd // 32  # FP8 + E8M0 per 32
    else:
        kv_row = (hd - r) + 2 * r + (hd - r) // 64  # FP8 nope + bf16 RoPE dims + E8M0 per 64
        index_row = ihd // 2 + ihd // 32
        for L, kind in enumerate(cfg.layer_kinds):
            m = cfg.compress_ratios[L]
            if kind == "csa":
                per_token_packed += (kv_row + index_row) / m
                per_token_ref += (hd + ihd) * 2 / m
                constant_ref += (2 * m + spare) * 2 * (2 * hd + 2 * ihd) * 4
            elif kind == "hca":
                per_token_packed += kv_row / m
                per_token_ref += hd * 2 / m
                constant_ref += (m + spare) * 2 * hd * 4
        ring_row = kv_row
    constant_packed = n_rings * w * ring_row
    constant_ref += n_rings * (w + spare) * hd * 2
    return {"per_token_packed": per_token_packed, "per_token_reference_bf16": per_token_ref,
            "constant_packed": constant_packed, "constant_reference_bf16": constant_ref}


def layer_roles(cfg: ModelConfig) -> list[dict]:
    rows = []
    for L in range(cfg.n_layers):
        m = cfg.compress_ratios[L]
        if isinstance(cfg, V41Config):
            if m == 0:
                mode = "window"
            elif cfg.kv_source_of(L) == L:
                mode = "full" + (" + candidate source" if L == cfg.candidate_source_layer else "")
            elif cfg.index_source_of(L) == L:
                mode = "reindex"
            else:
                mode = "reuse"
            row = {"layer": L, "ratio": m, "mode": mode, "kv_from": cfg.kv_source_of(L),
                   "topk_from": cfg.index_source_of(L)}
            if cfg.engram and L in cfg.engram.layer_ids:
                row["engram"] = True
        else:
            assert isinstance(cfg, V4Config)
            row = {"layer": L, "ratio": m, "mode": cfg.layer_kinds[L], "hash_moe": L < cfg.n_hash_layers}
        if cfg.dspark and L in cfg.dspark.target_layer_ids:
            row["dspark_input"] = True
        rows.append(row)
    return rows


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n}"


def step_bytes(cfg: ModelConfig, context: int) -> dict:
    """Bytes one decode step (one token) reads at a context depth, packed formats: every weight except the
    routed experts (only the selected k per layer) and the drafter, the Engram rows it gathers, and the
    decode state it reads (window rings, the selected compressed rows, every index key it scores, every
    visible HCA row)."""
    ckpt = inventory(cfg)
    weights = 0
    for name in ckpt.tensors:
        if name.startswith("mtp.") or ".engram.embed." in name:
            continue
        n = ckpt.nbytes(name)
        if ".experts." in name and ".shared_experts." not in name:
            n = n * cfg.n_activated_experts / cfg.n_routed_experts
        weights += n
    engram = 0
    if isinstance(cfg, V41Config) and cfg.engram:
        e = cfg.engram
        engram = len(e.layer_ids) * (e.max_ngram - 1) * e.n_heads * (e.head_dim + e.head_dim // 32)
    hd, r, ihd, w = cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, cfg.window_size
    state = 0.0
    if isinstance(cfg, V41Config):
        kv_row, index_row = hd // 2 + hd // 16, ihd // 2 + ihd // 32
        state += cfg.n_layers * min(w, context) * (hd + hd // 32)
        for L in range(cfg.n_layers):
            m = cfg.compress_ratios[L]
            if m:
                state += min(cfg.index_topk, context // m) * kv_row
                if cfg.index_source_of(L) == L:
                    state += (context // m) * index_row
    else:
        kv_row, index_row = (hd - r) + 2 * r + (hd - r) // 64, ihd // 2 + ihd // 32
        state += cfg.n_layers * min(w, context) * kv_row
        for L, kind in enumerate(cfg.layer_kinds):
            m = cfg.compress_ratios[L]
            if kind == "csa":
                state += min(cfg.index_topk, context // m) * kv_row + (context // m) * index_row
            elif kind == "hca":
                state += (context // m) * kv_row
    return {"weights": int(weights), "engram_rows": engram, "state": int(state),
            "total": int(weights + engram + state)}


# What tensor parallelism splits (appliance/parallel/sharding.py); everything else is replicated on every rank.
_SPLIT = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", "head.weight", ".markov_head.head.", ".markov_head.markov_w2.",
          ".shared_experts.")


def split_share(name: str, world: int) -> float:
    """The share of tensor `name` one of `world` ranks holds: 1/world for what the split divides (attention
    heads and groups, the head, routed and shared experts), 1 for what it replicates (the indexer too)."""
    routed = ".experts." in name and ".shared_experts." not in name
    return 1 / world if routed or any(k in name for k in _SPLIT) else 1.0


def rank_weights(cfg: ModelConfig, world: int) -> dict:
    """Weight bytes one of `world` ranks holds on its device, by dtype and by part (Engram tables stay on
    the host, memory-mapped once per box)."""
    ckpt = inventory(cfg)
    by_dtype: dict[str, float] = defaultdict(float)
    by_part: dict[str, float] = defaultdict(float)
    host = 0
    for name, (dtype, _) in ckpt.tensors.items():
        n = ckpt.nbytes(name)
        if where(name) == "host":
            host += n
            continue
        n *= split_share(name, world)
        by_dtype[dtype] += n
        by_part[_part(name)] += n
    return {"total": int(sum(by_dtype.values())), "by_dtype": {k: int(v) for k, v in by_dtype.items()},
            "by_part": {k: int(v) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
            "host_engram_tables": host}
