"""Tiny random transformers DeepseekV4ForCausalLM models (the V4 oracle), written in transformers'
save_pretrained format and again under the official names with the official config spelling."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from appliance.model.weights import official_name

CONFIGS = {
    # window + CSA + HCA, one hash layer, index_topk >= every row count (selection cannot differ)
    "all-kinds-full-topk": dict(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_hash_layers=1, index_topk=64, hc_mult=4, hc_sinkhorn_iters=20, num_experts_per_tok=2,
        n_routed_experts=8, qk_rope_head_dim=16, sliding_window=8),
    # selective top-k, two hash layers, HCA first
    "selective-topk": dict(
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        num_hash_layers=2, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, num_experts_per_tok=2,
        n_routed_experts=8, qk_rope_head_dim=16, sliding_window=16),
    # two hyper-connection copies, wider RoPE, more experts per token, no hash layers
    "hc2-rope32": dict(
        layer_types=["compressed_sparse_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_hash_layers=0, index_topk=5, hc_mult=2, hc_sinkhorn_iters=7, num_experts_per_tok=3,
        n_routed_experts=6, qk_rope_head_dim=32, sliding_window=12),
}

COMMON = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=64,
              q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=32,
              rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1})


def build(name: str, seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    spec = dict(CONFIGS[name])
    spec["num_hidden_layers"] = len(spec["layer_types"])
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**COMMON, **spec)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers initializes these to zero: randomize them
        for n, p in model.named_parameters():
            if n.endswith("sinks") or n.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            if n.endswith("tid2eid"):
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)]))
    return model


def save_both(model, root: Path) -> tuple[Path, Path]:
    """transformers' save_pretrained output, and the same weights under official names with the
    official config keys (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling)."""
    hf_dir, off_dir = root / "hf", root / "official"
    model.save_pretrained(hf_dir)
    off_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({official_name(k): v.contiguous() for k, v in tensors.items()}, str(off_dir / "model.safetensors"))
    c = model.config
    ratio = {"sliding_attention": 0, **c.compress_rates}
    official = {
        "model_type": "deepseek_v4", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "head_dim": c.head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "q_lora_rank": c.q_lora_rank,
        "o_groups": c.o_groups, "o_lora_rank": c.o_lora_rank, "rms_norm_eps": c.rms_norm_eps,
        "sliding_window": c.sliding_window, "compress_ratios": [ratio[t] for t in c.layer_types] + [0],
        "num_hash_layers": sum(t == "hash_moe" for t in c.mlp_layer_types), "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim, "index_topk": c.index_topk, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "rope_scaling": COMMON["rope_scaling"],
        "n_routed_experts": c.n_routed_experts, "n_shared_experts": 1, "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": c.routed_scaling_factor, "swiglu_limit": c.swiglu_limit, "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps, "num_nextn_predict_layers": 0,
    }
    if any(r not in (0, 4) and t == "compressed_sparse_attention" for t, r in
           zip(c.layer_types, official["compress_ratios"])):
        raise ValueError("the official spelling keys CSA on ratio 4")
    (off_dir / "config.json").write_text(json.dumps(official, indent=2))
    return hf_dir, off_dir
