"""Typed, frozen model configs parsed from a checkpoint's `config.json`.

Spellings read:
- DeepSeek-V4 (`model_type: deepseek_v4`): the official checkpoint's keys (`compress_ratios`,
  `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, `quantization_config`, `expert_dtype`) and
  transformers' keys (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters{main,compress}`,
  `partial_rotary_factor`);
- DeepSeek-V4.1 (`model_type: deepseek_v41`, text model in `text_config`);
- the flat reference-runtime config of either family (`dim`, `n_layers`, ...; no `model_type`).
Every missing or inconsistent field raises ConfigError naming the field and the file.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import ConfigError

# The checkpoint families a user names (tiny checkpoints, chat dialects): V4-Flash-0731 is a deepseek_v4
# config whose drafter is DSpark instead of the April MTP head.
FAMILIES = ("deepseek_v41", "deepseek_v4", "deepseek_v4_0731")

_MISSING = object()


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark block drafter (`mtp.0..2.*`)."""

    n_stages: int
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    n_activated_experts: int


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    bucket_base: int  # primes are drawn above bucket_base - 1
    pad_token_id: int
    compressed_vocab_size: int


@dataclass(frozen=True)
class ModelConfig:
    """Fields shared by both families. Shapes follow the official names (`dim`, `n_heads`, ...)."""

    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    norm_eps: float
    window_size: int
    compress_ratios: tuple[int, ...]  # one per backbone layer; 0 = window only
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float
    score_func: str
    swiglu_limit: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float  # YaRN on compressed layers; 1.0 = no YaRN
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    weight_block: tuple[int, int] | None  # FP8 block scales; None = unquantized checkpoint
    expert_dtype: str  # fp4 | fp8 | bf16
    act_block: int  # official numerics: block of the power-of-two FP8 activation quantization
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    n_mtp_layers: int
    dspark: DSparkConfig | None
    source: str  # the file this came from, for messages

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings


@dataclass(frozen=True)
class V4Config(ModelConfig):
    """DeepSeek-V4-Flash (April; MTP head) and V4-Flash-0731 (DSpark drafter)."""

    n_hash_layers: int = 0
    # per layer: "window", "csa" (overlapping compressor + indexer) or "hca" (all compressed rows attended)
    layer_kinds: tuple[str, ...] = ()

    @property
    def has_mtp(self) -> bool:
        return self.dspark is None and self.n_mtp_layers > 0


@dataclass(frozen=True)
class V41Config(ModelConfig):
    """DeepSeek-V4.1-Flash (text model)."""

    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 1
    engram: EngramConfig | None = None
    image_token_id: int | None = None
    has_vision: bool = False

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed rows `layer` reads (None for window-only layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose top-k list `layer` uses."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layers if s <= layer)


class _Reader:
    """Reads fields from one config dict, naming the file and field in every error."""

    def __init__(self, data: dict, path):
        self.data = data
        self.path = path

    def get(self, *keys: str, default=_MISSING, kind=None):
        for key in keys:
            if key in self.data and self.data[key] is not None:
                value = self.data[key]
                if kind is not None:
                    value = self._convert(key, value, kind)
                return value
        if default is _MISSING:
            raise ConfigError(self.path, " or ".join(keys), "missing")
        return default

    def _convert(self, key, value, kind):
        try:
            if kind is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                return int(value)
            if kind is float:
                if isinstance(value, bool):
                    raise ValueError
                return float(value)
            if kind is tuple:
                if not isinstance(value, (list, tuple)):
                    raise ValueError
                return tuple(int(v) for v in value)
        except (TypeError, ValueError):
            raise ConfigError(self.path, key, f"expected {kind.__name__}, got {value!r}", value) from None
        return value


def load_config(model_dir) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(model_dir, "model", "not a directory")
    if not path.is_file():
        raise ConfigError(path, "config.json", "missing: a model directory holds config.json and *.safetensors")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(path, "config.json", f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "config.json", "top level is not a JSON object")
    return parse_config(data, path)


def parse_config(data: dict, path="config.json") -> ModelConfig:
    model_type = data.get("model_type")
    if model_type is None:
        family = "deepseek_v41" if ("kv_source_layers" in data or "engram_layer_ids" in data) else "deepseek_v4"
        if "dim" not in data:
            raise ConfigError(path, "model_type", "missing (and not a flat reference config with `dim`)")
        return _parse_flat(_Reader(data, path), family)
    if model_type == "deepseek_v4":
        return _parse_hf_v4(_Reader(data, path))
    if model_type in ("deepseek_v41", "deepseek_v41_text"):
        text = data.get("text_config", data) if model_type == "deepseek_v41" else data
        if not isinstance(text, dict):
            raise ConfigError(path, "text_config", "not an object")
        merged = dict(text)
        for key in ("image_token_id", "bos_token_id", "eos_token_id"):
            if key not in merged and key in data:
                merged[key] = data[key]
        has_vision = isinstance(data.get("vision_config"), dict)
        return _parse_hf_v41(_Reader(merged, path), has_vision)
    raise ConfigError(path, "model_type", f"{model_type!r} is not served (deepseek_v4 or deepseek_v41)", model_type)


# --- shared field groups -----------------------------------------------------------------------------

# Fields both spellings carry, as (field, key in transformers' config.json, key in the flat reference
# config, type, default). A key may be a tuple of alternatives, the first present wins.
_COMMON_FIELDS = (
    ("vocab_size", "vocab_size", "vocab_size", int, _MISSING),
    ("dim", "hidden_size", "dim", int, _MISSING),
    ("n_layers", "num_hidden_layers", "n_layers", int, _MISSING),
    ("n_heads", "num_attention_heads", "n_heads", int, _MISSING),
    ("q_lora_rank", "q_lora_rank", "q_lora_rank", int, _MISSING),
    ("o_groups", "o_groups", "o_groups", int, _MISSING),
    ("o_lora_rank", "o_lora_rank", "o_lora_rank", int, _MISSING),
    ("norm_eps", "rms_norm_eps", "norm_eps", float, _MISSING),
    ("window_size", "sliding_window", "window_size", int, _MISSING),
    ("n_routed_experts", "n_routed_experts", "n_routed_experts", int, _MISSING),
    ("n_shared_experts", "n_shared_experts", "n_shared_experts", int, 1),
    ("n_activated_experts", "num_experts_per_tok", "n_activated_experts", int, _MISSING),
    ("moe_inter_dim", "moe_intermediate_size", "moe_inter_dim", int, _MISSING),
    ("route_scale", "routed_scaling_factor", "route_scale", float, 1.0),
    ("score_func", "scoring_func", "score_func", None, "sqrtsoftplus"),
    ("swiglu_limit", "swiglu_limit", "swiglu_limit", float, 0.0),
    ("hc_mult", "hc_mult", "hc_mult", int, _MISSING),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters", "hc_sinkhorn_iters", int, _MISSING),
    ("hc_eps", "hc_eps", "hc_eps", float, _MISSING),
    ("index_n_heads", "index_n_heads", "index_n_heads", int, _MISSING),
    ("index_head_dim", "index_head_dim", "index_head_dim", int, _MISSING),
    ("index_topk", "index_topk", "index_topk", int, _MISSING),
    ("max_position_embeddings", "max_position_embeddings", "max_seq_len", int, 1 << 20),
)

# V4.1's layer wiring and Engram, in the same form.
_V41_FIELDS = (
    ("kv_source_layers", "kv_source_layer_ids", "kv_source_layers", tuple, _MISSING),
    ("index_source_layers", "index_source_layer_ids", "index_source_layers", tuple, _MISSING),
    ("candidate_source_layer", "candidate_source_layer_id", "candidate_source_layer", int, _MISSING),
    ("candidate_topk_blocks", "candidate_topk_blocks", "candidate_topk_blocks", int, _MISSING),
    ("candidate_block_size", "candidate_block_size", "candidate_block_size", int, _MISSING),
    ("image_token_id", "image_token_id", "image_token_id", int, None),
)
_ENGRAM_FIELDS = (
    ("layer_ids", "engram_layer_ids", "engram_layer_ids", tuple, _MISSING),
    ("num_embeddings", "engram_num_embeddings", "engram_num_embeddings", tuple, _MISSING),
    ("max_ngram", "engram_max_ngram_size", "engram_max_ngram_size", int, _MISSING),
    ("n_heads", "engram_n_heads", "engram_n_heads", int, _MISSING),
    ("head_dim", "engram_head_dim", "engram_head_dim", int, _MISSING),
    ("bucket_base", "engram_vocab_size", "engram_vocab_size", int, _MISSING),
    ("pad_token_id", "engram_pad_token_id", ("engram_pad_id", "engram_pad_token_id"), int, _MISSING),
    ("compressed_vocab_size", "engram_compressed_vocab_size", "engram_compressed_vocab_size", int, _MISSING),
)


def _read(r: _Reader, fields, spelling: str) -> dict:
    """`fields` read in one spelling: "hf" (transformers' names) or "flat" (the reference runtime's)."""
    out = {}
    for field, hf_key, flat_key, kind, default in fields:
        key = hf_key if spelling == "hf" else flat_key
        out[field] = r.get(*(key if isinstance(key, tuple) else (key,)), default=default, kind=kind)
    return out


def _engram(r: _Reader, spelling: str) -> EngramConfig | None:
    return EngramConfig(**_read(r, _ENGRAM_FIELDS, spelling)) if "engram_layer_ids" in r.data else None


def _hf_common(r: _Reader) -> dict:
    head_dim = r.get("head_dim", kind=int)
    if "qk_rope_head_dim" in r.data:
        rope_head_dim = r.get("qk_rope_head_dim", kind=int)
    elif "partial_rotary_factor" in r.data:
        rope_head_dim = int(round(head_dim * r.get("partial_rotary_factor", kind=float)))
    else:
        rope_head_dim = head_dim // 8
    eos = r.get("eos_token_id", default=1)
    if isinstance(eos, list):
        eos = eos[0]
    return dict(
        **_read(r, _COMMON_FIELDS, "hf"),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        bos_token_id=int(r.get("bos_token_id", default=0)),
        eos_token_id=int(eos),
        source=str(r.path),
    )


def _hf_rope(r: _Reader) -> dict:
    params = r.get("rope_parameters", default=None)
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params["main"], params["compress"]
        yarn = comp.get("rope_type", comp.get("type")) == "yarn"
        return dict(
            rope_theta=float(main.get("rope_theta", r.get("rope_theta", default=10000.0))),
            compress_rope_theta=float(comp.get("rope_theta", r.get("compress_rope_theta", default=160000.0))),
            rope_factor=float(comp.get("factor", 1.0)) if yarn else 1.0,
            original_seq_len=int(comp.get("original_max_position_embeddings", 65536)),
            beta_fast=float(comp.get("beta_fast", 32.0)),
            beta_slow=float(comp.get("beta_slow", 1.0)),
        )
    scaling = r.get("rope_scaling", default=None) or {}
    yarn = scaling.get("rope_type", scaling.get("type")) == "yarn"
    return dict(
        rope_theta=r.get("rope_theta", default=10000.0, kind=float),
        compress_rope_theta=r.get("compress_rope_theta", default=160000.0, kind=float),
        rope_factor=float(scaling.get("factor", 1.0)) if yarn else 1.0,
        original_seq_len=int(scaling.get("original_max_position_embeddings", 65536)),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
    )


def _hf_quant(r: _Reader, default_act_block: int) -> dict:
    q = r.get("quantization_config", default=None)
    expert_dtype = r.get("expert_dtype", default=None)
    if isinstance(q, dict):
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise ConfigError(r.path, "quantization_config.weight_block_size", f"expected [rows, cols], got {block!r}")
        expert_dtype = q.get("expert_dtype", expert_dtype)
        return dict(weight_block=(int(block[0]), int(block[1])), expert_dtype=expert_dtype or "fp8",
                    act_block=int(block[1]))
    return dict(weight_block=None, expert_dtype=expert_dtype or "bf16", act_block=default_act_block)


def _hf_dspark(r: _Reader, n_stages: int, default_experts: int, default_topk: int) -> DSparkConfig | None:
    if "dspark_block_size" not in r.data:
        return None
    return DSparkConfig(
        n_stages=n_stages,
        block_size=r.get("dspark_block_size", kind=int),
        noise_token_id=r.get("dspark_noise_token_id", kind=int),
        target_layer_ids=r.get("dspark_target_layer_ids", kind=tuple),
        markov_rank=r.get("dspark_markov_rank", kind=int),
        n_routed_experts=r.get("dspark_n_routed_experts", default=default_experts, kind=int),
        n_activated_experts=r.get("dspark_num_experts_per_tok", "dspark_n_activated_experts",
                                  default=default_topk, kind=int),
    )


# --- DeepSeek-V4 -------------------------------------------------------------------------------------

_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LAYER_TYPE_KIND = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                    "heavily_compressed_attention": "hca"}


def _official_kind(ratio: int) -> str:
    """The official code gives a layer the overlapping compressor and the indexer when its ratio is 4."""
    return "window" if ratio == 0 else "csa" if ratio == 4 else "hca"


def _parse_hf_v4(r: _Reader) -> V4Config:
    common = _hf_common(r)
    n = common["n_layers"]
    if "compress_ratios" in r.data:
        ratios = r.get("compress_ratios", kind=tuple)
        kinds = tuple(_official_kind(x) for x in ratios[:n])
    elif "layer_types" in r.data:
        types = r.get("layer_types")
        rates = r.get("compress_rates", default={}) or {}
        bad = [t for t in types if t not in _LAYER_TYPE_RATIO]
        if bad:
            raise ConfigError(r.path, "layer_types", f"unknown layer types {bad}", bad)
        ratios = tuple(int(rates.get(t, _LAYER_TYPE_RATIO[t])) if t != "sliding_attention" else 0 for t in types)
        kinds = tuple(_LAYER_TYPE_KIND[t] for t in types[:n])
    else:
        raise ConfigError(r.path, "compress_ratios or layer_types", "missing (the layer pattern must be explicit)")
    if "mlp_layer_types" in r.data:
        mlp = r.get("mlp_layer_types")
        n_hash = sum(1 for t in mlp if t == "hash_moe")
        if list(mlp[:n_hash]) != ["hash_moe"] * n_hash:
            raise ConfigError(r.path, "mlp_layer_types", "hash_moe layers must come first", mlp)
    else:
        n_hash = r.get("num_hash_layers", "n_hash_layers", default=0, kind=int)
    n_mtp = r.get("num_nextn_predict_layers", default=0, kind=int)
    dspark = _hf_dspark(r, n_stages=3, default_experts=common["n_routed_experts"],
                        default_topk=common["n_activated_experts"])
    if dspark is not None:
        n_mtp = dspark.n_stages  # 0731 still says 1 while storing 3 stages
    if len(kinds) < n:
        field = "compress_ratios" if "compress_ratios" in r.data else "layer_types"
        raise ConfigError(r.path, field, f"{len(kinds)} entries for {n} layers")
    cfg = V4Config(family="deepseek_v4", compress_ratios=tuple(ratios[:n]), n_mtp_layers=n_mtp, dspark=dspark,
                   n_hash_layers=n_hash, layer_kinds=kinds, **common, **_hf_rope(r),
                   **_hf_quant(r, default_act_block=128))
    _check_common(cfg, ratios, r.path)
    return cfg


# --- DeepSeek-V4.1 -----------------------------------------------------------------------------------


def _parse_hf_v41(r: _Reader, has_vision: bool) -> V41Config:
    common = _hf_common(r)
    ratios = r.get("compress_ratios", kind=tuple)
    n_mtp = r.get("num_nextn_predict_layers", default=0, kind=int)
    cfg = V41Config(
        family="deepseek_v41",
        compress_ratios=tuple(ratios[: common["n_layers"]]),
        n_mtp_layers=n_mtp,
        dspark=_hf_dspark(r, n_mtp, common["n_routed_experts"], common["n_activated_experts"]),
        **_read(r, _V41_FIELDS, "hf"),
        engram=_engram(r, "hf"),
        has_vision=has_vision,
        **common,
        **_hf_rope(r),
        **_hf_quant(r, default_act_block=32),
    )
    _check_common(cfg, ratios, r.path)
    _check_v41(cfg, r.path)
    return cfg


# --- flat reference-runtime config (inference/config.json) ------------------------------------------


def _parse_flat(r: _Reader, family: str) -> ModelConfig:
    dtype = r.get("dtype", default="bf16")
    wb = 32 if family == "deepseek_v41" else 128
    common = dict(
        family=family,
        **_read(r, _COMMON_FIELDS, "flat"),
        head_dim=r.get("head_dim", kind=int),
        rope_head_dim=r.get("rope_head_dim", kind=int),
        rope_theta=r.get("rope_theta", default=10000.0, kind=float),
        compress_rope_theta=r.get("compress_rope_theta", default=160000.0, kind=float),
        rope_factor=r.get("rope_factor", default=1.0, kind=float),
        original_seq_len=r.get("original_seq_len", default=65536, kind=int),
        beta_fast=r.get("beta_fast", default=32.0, kind=float),
        beta_slow=r.get("beta_slow", default=1.0, kind=float),
        weight_block=(wb, wb) if dtype == "fp8" else None,
        expert_dtype=r.get("expert_dtype", default="fp8" if dtype == "fp8" else "bf16"),
        act_block=wb,
        bos_token_id=r.get("bos_token_id", default=0, kind=int),
        eos_token_id=r.get("eos_token_id", default=1, kind=int),
        n_mtp_layers=r.get("n_mtp_layers", default=0, kind=int),
        source=str(r.path),
    )
    ratios = r.get("compress_ratios", kind=tuple)
    common["compress_ratios"] = tuple(ratios[: common["n_layers"]])
    common["dspark"] = _hf_dspark(r, common["n_mtp_layers"], common["n_routed_experts"],
                                  common["n_activated_experts"])
    if family == "deepseek_v4":
        kinds = tuple(_official_kind(x) for x in common["compress_ratios"])
        cfg = V4Config(n_hash_layers=r.get("n_hash_layers", default=0, kind=int), layer_kinds=kinds, **common)
        _check_common(cfg, ratios, r.path)
        return cfg
    cfg = V41Config(**_read(r, _V41_FIELDS, "flat"), engram=_engram(r, "flat"),
                    has_vision=r.get("vision_n_layers", default=0, kind=int) > 0, **common)
    _check_common(cfg, ratios, r.path)
    _check_v41(cfg, r.path)
    return cfg


# --- consistency -------------------------------------------------------------------------------------


def _check_common(cfg: ModelConfig, ratios, path) -> None:
    def bad(field, message, value=None):
        raise ConfigError(path, field, message, value)

    for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "window_size", "n_routed_experts", "n_activated_experts", "moe_inter_dim", "hc_mult"):
        if getattr(cfg, name) <= 0:
            bad(name, f"must be positive, got {getattr(cfg, name)}", getattr(cfg, name))
    if len(ratios) < cfg.n_layers:
        bad("compress_ratios", f"{len(ratios)} entries for {cfg.n_layers} layers", list(ratios))
    if not 0 < cfg.rope_head_dim <= cfg.head_dim or cfg.rope_head_dim % 2:
        bad("qk_rope_head_dim", f"{cfg.rope_head_dim} must be even and within head_dim {cfg.head_dim}")
    if cfg.n_heads % cfg.o_groups:
        bad("o_groups", f"{cfg.o_groups} does not divide num_attention_heads {cfg.n_heads}")
    if cfg.n_activated_experts > cfg.n_routed_experts:
        bad("num_experts_per_tok", f"{cfg.n_activated_experts} > n_routed_experts {cfg.n_routed_experts}")
    if cfg.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        bad("scoring_func", f"{cfg.score_func!r} is not sqrtsoftplus, softmax or sigmoid", cfg.score_func)
    if cfg.expert_dtype not in ("fp4", "fp8", "bf16"):
        bad("expert_dtype", f"{cfg.expert_dtype!r} is not fp4, fp8 or bf16", cfg.expert_dtype)
    if cfg.dspark is not None:
        for t in cfg.dspark.target_layer_ids:
            if not 0 <= t < cfg.n_layers:
                bad("dspark_target_layer_ids", f"layer {t} outside 0..{cfg.n_layers - 1}", t)
        if not 0 <= cfg.dspark.noise_token_id < cfg.vocab_size:
            bad("dspark_noise_token_id", f"{cfg.dspark.noise_token_id} outside the vocabulary")
    if cfg.family == "deepseek_v4":
        for i, r in enumerate(cfg.compress_ratios):
            if r != 0 and r < 2:
                bad("compress_ratios", f"layer {i}: ratio {r} (V4 compressed layers need ratio >= 2)", r)


def _check_v41(cfg: V41Config, path) -> None:
    def bad(field, message, value=None):
        raise ConfigError(path, field, message, value)

    for i, r in enumerate(cfg.compress_ratios):
        if r not in (0, 1, 2):
            bad("compress_ratios", f"layer {i}: ratio {r} (V4.1 uses 0, 1 or 2)", r)
    compressed = [i for i, r in enumerate(cfg.compress_ratios) if r]
    if compressed and (not cfg.kv_source_layers or cfg.kv_source_layers[0] != compressed[0]):
        bad("kv_source_layer_ids", f"{list(cfg.kv_source_layers)}: the first compressed layer "
            f"({compressed[0]}) must be a KV source")
    for s in cfg.kv_source_layers:
        if not 0 <= s < cfg.n_layers or cfg.compress_ratios[s] == 0:
            bad("kv_source_layer_ids", f"layer {s} is not a compressed layer", s)
    for i in compressed:
        src = max(s for s in cfg.kv_source_layers if s <= i)
        if cfg.compress_ratios[src] != cfg.compress_ratios[i]:
            bad("compress_ratios", f"layer {i} (ratio {cfg.compress_ratios[i]}) reads KV source {src} "
                f"(ratio {cfg.compress_ratios[src]})")
    if not set(cfg.kv_source_layers) <= set(cfg.index_source_layers):
        bad("index_source_layer_ids", "every KV source must also be an index source", list(cfg.index_source_layers))
    for s in cfg.index_source_layers:
        if not 0 <= s < cfg.n_layers or cfg.compress_ratios[s] == 0:
            bad("index_source_layer_ids", f"layer {s} is not a compressed layer", s)
    if cfg.candidate_source_layer not in cfg.kv_source_layers:
        bad("candidate_source_layer_id", f"{cfg.candidate_source_layer} is not a KV source")
    if cfg.candidate_block_size <= 0 or cfg.candidate_topk_blocks <= 0:
        bad("candidate_block_size", "candidate block size and top blocks must be positive")
    if cfg.engram is not None:
        e = cfg.engram
        if len(e.num_embeddings) != len(e.layer_ids):
            bad("engram_num_embeddings", f"{len(e.num_embeddings)} entries for {len(e.layer_ids)} Engram layers")
        if e.max_ngram < 2:
            bad("engram_max_ngram_size", f"{e.max_ngram} < 2")


def summary(cfg: ModelConfig) -> dict:
    """Plain dict of the config (for `appliance info --json`)."""
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for k, v in ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg))}
