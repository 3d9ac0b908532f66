"""What a model is and what it weighs, from its config alone: architecture, layer roles, weight bytes by
dtype, by part and by where they live, and decode-state bytes per token of context (packed formats, as
the kernels of the official release store them, and as this engine holds them).

Every fact is read off the fast path built on the meta device (shapes.py `meta_model`), so the code that
owns it decides: which tensors the model reads in which stored format (the build), what one rank holds of
each (the split of appliance/parallel/sharding.py applied to that build), which tables stay in host memory
(appliance/parallel/placement.py), and which buffers the decode state has at which widths (the model's and
the drafter's `new_state`). Only the packed row formats are stated here (`packed_row`): the state holds
its rows fake-quantized to them, in the run's dtype."""

from collections import defaultdict

from appliance.model.config import ModelConfig, V4Config, V41Config

from .memory import state_cost
from .shapes import MetaModel, weights


def weight_bytes(mm: MetaModel) -> dict:
    """The checkpoint's bytes by stored dtype, by where they live and by part (`mm`: a single-device build)."""
    by_dtype: dict[str, int] = defaultdict(int)
    by_where: dict[str, int] = defaultdict(int)
    by_part: dict[str, int] = defaultdict(int)
    table = weights(mm)
    for name, w in table.items():
        by_dtype[w.dtype] += w.whole
        by_where[w.where] += w.whole
        by_part[_part(name)] += w.whole
    return {"total": sum(by_dtype.values()), "by_dtype": dict(by_dtype), "by_where": dict(by_where),
            "by_part": dict(sorted(by_part.items(), key=lambda kv: -kv[1])), "tensors": len(table)}


def rank_weights(mm: MetaModel) -> dict:
    """Weight bytes one rank of `mm` (split or not) holds on its device in their stored format, by dtype and
    by part (the plan's `weights`; copies made at load are the plan's `float_copies_and_caches`), and the
    Engram tables it leaves in host memory (memory-mapped once per box)."""
    by_dtype: dict[str, int] = defaultdict(int)
    by_part: dict[str, int] = defaultdict(int)
    host = 0
    for name, w in weights(mm).items():
        if w.where == "host":
            host += w.held
            continue
        by_dtype[w.dtype] += w.held
        by_part[_part(name)] += w.held
    return {"total": sum(by_dtype.values()), "by_dtype": dict(by_dtype),
            "by_part": dict(sorted(by_part.items(), key=lambda kv: -kv[1])), "host_engram_tables": host}


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


def packed_row(cfg: ModelConfig, buffer: str, width: int) -> int:
    """Bytes of one `width`-wide row of the decode state's buffer `buffer` (its name in the state) in the
    packed format of the official kernels, which the model's fake quantization rounds it to. The
    compressors' carries are float32 projections in either."""
    kind = buffer.partition(".")[0]
    if kind in ("compressor", "index_compressor"):
        return 4 * width
    if kind == "index_keys":
        return width // 2 + width // 32  # FP4 codes + E8M0 per 32
    if isinstance(cfg, V41Config):
        if kind == "kv":
            return width // 2 + width // 16  # FP4 codes + e4m3 per 16
        return width + width // 32  # window keys (the drafter's too): FP8 + E8M0 per 32, all dims
    r = cfg.rope_head_dim
    return (width - r) + 2 * r + (width - r) // 64  # FP8 non-RoPE dims + bf16 RoPE dims + E8M0 per 64


def _states(mm: MetaModel, capacity: int, spare: int = 16) -> list:
    states = [mm.model.new_state(capacity, spare, device="meta")]
    if mm.drafter is not None:
        states.append(mm.drafter.new_state(capacity, spare, device="meta"))
    return states


def state_bytes(mm: MetaModel) -> dict:
    """Decode-state bytes of the target and its drafter: `per_token_packed`, the compressed rows (KV and
    index keys, token ids aside) in the packed formats; `constant_packed`, the rings at the positions their
    readers reach; and both as `mm`'s run holds them (`state_cost`: ids, trash rows and the rings' rewind
    slack included, in its dtype)."""
    per_token = constant = 0.0
    for state in _states(mm, 1 << 12):
        per_token += sum(packed_row(mm.cfg, name, rows.data.shape[1]) / rows.ratio for name, rows in state.rows.items())
        constant += sum(ring.reach * packed_row(mm.cfg, name, ring.data.shape[1]) for name, ring in state.rings.items())
    held_per_token, held_constant = state_cost(mm)
    dtype = str(mm.runtime.dtype).removeprefix("torch.")
    return {"per_token_packed": per_token, "constant_packed": int(constant), "dtype": dtype,
            "per_token_held": held_per_token, "constant_held": held_constant}


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


def step_bytes(mm: MetaModel, context: int) -> dict:
    """Bytes one decode step (one token) of the single-device build `mm` reads at a context depth, packed
    formats: every weight on the device except the routed experts (only the selected k per layer) and the
    drafter, the Engram rows it gathers, and the decode state it reads (window rings, the selected
    compressed rows, every index key it scores, every visible HCA row)."""
    cfg = mm.cfg
    weights_read = 0.0
    for name, w in weights(mm).items():
        part = _part(name)
        if part == "drafter" or ".engram.embed." in name:  # Engram's tables: the rows gathered, wherever they live
            continue
        weights_read += w.whole * (cfg.n_activated_experts / cfg.n_routed_experts if part == "routed experts" else 1)
    engram = 0
    if isinstance(cfg, V41Config) and cfg.engram:
        e = cfg.engram
        engram = len(e.layer_ids) * (e.max_ngram - 1) * e.n_heads * (e.head_dim + e.head_dim // 32)
    state = _states(mm, context + 1)[0]
    read = sum(min(ring.reach, context) * packed_row(cfg, name, ring.data.shape[1])
               for name, ring in state.rings.items() if name.startswith("window."))
    for L in range(cfg.n_layers):
        if isinstance(cfg, V41Config):  # every compressed layer selects among its KV source's rows
            if not cfg.compress_ratios[L]:
                continue
            kv, selects = f"kv.{cfg.kv_source_of(L)}", True
            keys = f"index_keys.{cfg.kv_source_of(L)}" if cfg.index_source_of(L) == L else None
        else:  # CSA selects among its rows by its index keys, HCA reads every row
            kv, keys = f"kv.{L}", f"index_keys.{L}"
            if kv not in state.rows:
                continue
            selects = keys in state.rows
            keys = keys if selects else None
        rows = state.rows[kv]
        visible = context // rows.ratio
        read += (min(cfg.index_topk, visible) if selects else visible) * packed_row(cfg, kv, rows.data.shape[1])
        if keys is not None:
            read += visible * packed_row(cfg, keys, state.rows[keys].data.shape[1])
    return {"weights": int(weights_read), "engram_rows": engram, "state": int(read),
            "total": int(weights_read + engram + read)}
