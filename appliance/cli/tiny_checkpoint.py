"""Tiny random checkpoints in the official names and formats (FP8 e4m3 + E8M0 block scales, FP4 e2m1
experts, BF16 / F32 elsewhere) with a byte-level BPE tokenizer.json: small enough for CPU tests, shaped
like the real models (every layer role, Engram, DSpark or MTP included).

Weights are random with scales that keep activations O(1) so that the model's output depends on its
input. The same seed writes byte-identical files (the embedded default model is one of these).

Beside the CLI (`appliance tiny`, and the tests' fixtures), not in the model wing: the tokenizer carries
DeepSeek's chat tokens, and the model wing knows no chat.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from appliance.chat.dialects import BOS, DSML, EOS, HIDDEN_TOKENS, PAD, THINK_CLOSE, THINK_OPEN
from appliance.model.config import FAMILIES
from appliance.model.engram import build_token_map, primes
from kernels.formats import encode_fp4, encode_fp8

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A decode appliance serves one user as fast as it can. ",
    "Speculative decoding drafts a few tokens and verifies them in one forward pass of the target model. ",
    "Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation; quotes \"x\" and 'y'. ",
    "Sparse attention keeps a window of recent tokens and a compressed memory of the distant past. ",
]
SPECIALS = [BOS, EOS, PAD, "<noise>"]  # ids 0..3: BOS and EOS at DeepSeek's ids
# DeepSeek's other special tokens (roles, think tags, the DSML marker, tasks), so the chat encoding tokenizes
# on a tiny model as on the real one: each one id.
CHAT_SPECIALS = [t for t in (THINK_OPEN, THINK_CLOSE, DSML, *HIDDEN_TOKENS) if t not in SPECIALS]


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """Byte-level BPE trained on a fixed corpus, then DeepSeek's chat special tokens, padded with <unused_k>
    tokens to exactly vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_special_tokens(CHAT_SPECIALS)
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise ValueError(f"tokenizer came out with {n} tokens > vocab_size {vocab_size}")
    tok.add_special_tokens([f"<unused_{i}>" for i in range(vocab_size - n)])
    tok.save(str(path))


class _Writer:
    """Collects tensors in official names and formats. Random numbers come from `device` (a GPU makes the
    full-width slice in seconds); the tensors are kept on the host for writing."""

    def __init__(self, seed: int, block: int, device: str = "cpu"):
        self.device = device
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.block = block
        self.t: dict[str, torch.Tensor] = {}

    def randn(self, *shape, std=1.0):
        return torch.randn(*shape, generator=self.g, device=self.device) * std

    def __setitem__(self, name, value):
        self.t[name] = value.cpu()

    def dense(self, name, out_f, in_f, dtype=torch.bfloat16, gain=1.0):
        self[name] = self.randn(out_f, in_f, std=gain / math.sqrt(in_f)).to(dtype)

    def fp8(self, name, out_f, in_f, gain=1.0):
        w = self.randn(out_f, in_f, std=gain / math.sqrt(in_f))
        self[f"{name}.weight"], self[f"{name}.scale"] = encode_fp8(w, (self.block, self.block))

    def fp4(self, name, out_f, in_f, gain=1.0):
        self[f"{name}.weight"], self[f"{name}.scale"] = encode_fp4(self.randn(out_f, in_f, std=gain / math.sqrt(in_f)))

    def norm(self, name, dim):
        self[name] = (1.0 + self.randn(dim, std=0.1)).to(torch.bfloat16)

    def f32(self, name, *shape, std=1.0, mean=0.0):
        self[name] = (mean + self.randn(*shape, std=std)).float()


def _hc(w: _Writer, prefix: str, hc: int, dim: int):
    n = hc * (2 + hc)
    w.f32(f"{prefix}_fn", n, hc * dim, std=0.5 / math.sqrt(hc * dim))
    w.f32(f"{prefix}_base", n, std=0.5)
    w.f32(f"{prefix}_scale", 3, std=0.1, mean=1.0)


def _moe(w: _Writer, prefix: str, dim: int, inter: int, n_experts: int, fp4: bool, vocab=0, top_k=0, hashed=False):
    w.dense(f"{prefix}.gate.weight", n_experts, dim, gain=2.0)
    if hashed:
        w[f"{prefix}.gate.tid2eid"] = torch.stack(
            [torch.randperm(n_experts, generator=w.g, device=w.device)[:top_k] for _ in range(vocab)]).long()
    else:
        w.f32(f"{prefix}.gate.bias", n_experts, std=0.3)
    expert = w.fp4 if fp4 else w.fp8
    for e in range(n_experts):
        expert(f"{prefix}.experts.{e}.w1", inter, dim, gain=2.0)
        expert(f"{prefix}.experts.{e}.w2", dim, inter)
        expert(f"{prefix}.experts.{e}.w3", inter, dim, gain=2.0)
    for k, (o, i) in {"w1": (inter, dim), "w2": (dim, inter), "w3": (inter, dim)}.items():
        w.fp8(f"{prefix}.shared_experts.{k}", o, i, gain=2.0 if k != "w2" else 1.0)


def _attention(w: _Writer, p: str, c: dict):
    dim, hd, heads = c["dim"], c["head_dim"], c["heads"]
    w.fp8(f"{p}.wq_a", c["q_lora"], dim)
    w.norm(f"{p}.q_norm.weight", c["q_lora"])
    w.fp8(f"{p}.wq_b", heads * hd, c["q_lora"])
    w.fp8(f"{p}.wkv", hd, dim)
    w.norm(f"{p}.kv_norm.weight", hd)
    w.fp8(f"{p}.wo_a", c["o_groups"] * c["o_lora"], heads * hd // c["o_groups"])
    w.fp8(f"{p}.wo_b", dim, c["o_groups"] * c["o_lora"])
    w.f32(f"{p}.attn_sink", heads, std=1.0)


def _block_common(w: _Writer, p: str, c: dict):
    w.norm(f"{p}.attn_norm.weight", c["dim"])
    w.norm(f"{p}.ffn_norm.weight", c["dim"])
    _hc(w, f"{p}.hc_attn", c["hc"], c["dim"])
    _hc(w, f"{p}.hc_ffn", c["hc"], c["dim"])
    _attention(w, f"{p}.attn", c)


# --- DeepSeek-V4.1 -----------------------------------------------------------------------------------

# every split dimension divides over 4 ranks in whole FP8 blocks (heads, output groups, the shared expert's
# intermediate, experts, vocabulary), so the tiny models also test the four-rank split
V41_SHAPE = dict(vocab=512, dim=64, layers=8, heads=4, head_dim=64, rope=16, q_lora=64, o_groups=4, o_lora=32,
                 hc=4, inter=128, experts=8, top_k=2, window=16, ratios=[0, 0, 2, 2, 1, 1, 1, 1],
                 kv_sources=[2, 4], index_sources=[2, 4, 6], candidate_source=4, candidate_blocks=2,
                 candidate_block_size=4, index_heads=4, index_head_dim=32, index_topk=8, engram_layers=[1, 3],
                 engram_heads=2, engram_head_dim=32, engram_ngram=4, engram_base=64, dspark_targets=[5, 6, 7],
                 dspark_experts=4, dspark_top_k=2, markov_rank=32, block=32)


# One slice of DeepSeek-V4.1-Flash at full width (hidden 5120, 64 heads x 512, q-LoRA 1280, 8 groups x 1024,
# experts of 2304, indexer 32 x 128, the real vocabulary) with 4 layers covering every role, fewer experts,
# and small Engram tables: for measuring decode on a GPU (scripts/device-check.sh).
V41_SLICE = dict(vocab=129280, dim=5120, layers=4, heads=64, head_dim=512, rope=64, q_lora=1280, o_groups=8,
                 o_lora=1024, hc=4, inter=2304, experts=32, top_k=6, window=128, ratios=[0, 0, 2, 1],
                 kv_sources=[2, 3], index_sources=[2, 3], candidate_source=3, candidate_blocks=2048,
                 candidate_block_size=8, index_heads=32, index_head_dim=128, index_topk=512, engram_layers=[1],
                 engram_heads=8, engram_head_dim=256, engram_ngram=4, engram_base=1000, dspark_targets=[1, 2, 3],
                 dspark_experts=16, dspark_top_k=3, markov_rank=256, block=32)
SHAPES = {"tiny": V41_SHAPE, "slice": V41_SLICE}


def _write_v41(out: Path, seed: int, shape: str = "tiny") -> None:
    c = SHAPES[shape]
    write_tokenizer(out / "tokenizer.json", c["vocab"])
    tok = json.loads((out / "tokenizer.json").read_text())
    noise_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<noise>")
    token_map = build_token_map(out / "tokenizer.json", expected_size=None)
    compressed_vocab = int(token_map.max()) + 1
    pr = primes(c["engram_layers"], c["engram_ngram"], c["engram_heads"], c["engram_base"])
    rows = [sum(p) for p in pr.values()]
    w = _Writer(seed, c["block"], "cuda" if shape != "tiny" and torch.cuda.is_available() else "cpu")
    dim, hc = c["dim"], c["hc"]
    w.dense("embed.weight", c["vocab"], dim, gain=math.sqrt(dim))
    w.dense("head.weight", c["vocab"], dim, gain=2.0)
    w.norm("norm.weight", dim)
    for L in range(c["layers"]):
        p = f"layers.{L}"
        _block_common(w, p, c)
        if L in c["kv_sources"]:
            ratio = c["ratios"][L]
            w.dense(f"{p}.attn.compressor.wkv.weight", c["head_dim"], dim)
            if ratio > 1:
                w.dense(f"{p}.attn.compressor.wgate.weight", c["head_dim"], dim)
            w.norm(f"{p}.attn.compressor.norm.weight", c["head_dim"])
            w.dense(f"{p}.attn.indexer.wk.weight", c["index_head_dim"], c["head_dim"])
            w.norm(f"{p}.attn.indexer.k_norm.weight", c["index_head_dim"])
        if L in c["index_sources"]:
            w.fp8(f"{p}.attn.indexer.wq_b", c["index_heads"] * c["index_head_dim"], c["q_lora"])
            w.dense(f"{p}.attn.indexer.weights_proj.weight", c["index_heads"], dim)
        _moe(w, f"{p}.ffn", dim, c["inter"], c["experts"], fp4=True)
        if L in c["engram_layers"]:
            r = rows[c["engram_layers"].index(L)]
            n_cols = (c["engram_ngram"] - 1) * c["engram_heads"]
            w.fp8(f"{p}.engram.wkv", (hc + 1) * dim, n_cols * c["engram_head_dim"])
            table = w.randn(r, c["engram_head_dim"])
            w[f"{p}.engram.embed.weight"], w[f"{p}.engram.embed.scale"] = encode_fp8(table, (1, 32))
            w[f"{p}.engram.q_weight"] = (1 + w.randn(hc, dim, std=0.1)).to(torch.bfloat16)
            w[f"{p}.engram.k_weight"] = (1 + w.randn(hc, dim, std=0.1)).to(torch.bfloat16)
    for s in range(3):
        p = f"mtp.{s}"
        _block_common(w, p, c)
        _moe(w, f"{p}.ffn", dim, c["inter"], c["dspark_experts"], fp4=True)
    w.fp8("mtp.0.main_proj", dim, dim * len(c["dspark_targets"]))
    w.norm("mtp.0.main_norm.weight", dim)
    w.norm("mtp.2.norm.weight", dim)
    w.dense("mtp.2.markov_head.embed.weight", c["vocab"], c["markov_rank"], gain=math.sqrt(c["markov_rank"]))
    w.dense("mtp.2.markov_head.head.weight", c["vocab"], c["markov_rank"], gain=0.5)
    w.dense("mtp.2.confidence_head.proj.weight", 1, dim + c["markov_rank"])
    save_file(w.t, str(out / "model.safetensors"))
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": c["vocab"], "hidden_size": dim,
        "num_hidden_layers": c["layers"], "num_nextn_predict_layers": 3, "num_attention_heads": c["heads"],
        "num_key_value_heads": 1, "head_dim": c["head_dim"], "qk_rope_head_dim": c["rope"], "q_lora_rank": c["q_lora"],
        "o_groups": c["o_groups"], "o_lora_rank": c["o_lora"], "rms_norm_eps": 1e-20, "sliding_window": c["window"],
        "compress_ratios": c["ratios"] + [0, 0, 0], "kv_source_layer_ids": c["kv_sources"],
        "index_source_layer_ids": c["index_sources"], "candidate_source_layer_id": c["candidate_source"],
        "candidate_topk_blocks": c["candidate_blocks"], "candidate_block_size": c["candidate_block_size"],
        "index_n_heads": c["index_heads"], "index_head_dim": c["index_head_dim"], "index_topk": c["index_topk"],
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "max_position_embeddings": 4096 if shape == "tiny" else 1 << 20, "n_routed_experts": c["experts"],
        "n_shared_experts": 1,
        "num_experts_per_tok": c["top_k"], "moe_intermediate_size": c["inter"], "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": hc, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": c["engram_layers"],
        "engram_num_embeddings": rows, "engram_max_ngram_size": c["engram_ngram"],
        "engram_n_heads": c["engram_heads"], "engram_head_dim": c["engram_head_dim"],
        "engram_vocab_size": c["engram_base"], "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": compressed_vocab, "dspark_block_size": 5, "dspark_noise_token_id": noise_id,
        "dspark_target_layer_ids": c["dspark_targets"], "dspark_markov_rank": c["markov_rank"],
        "dspark_n_routed_experts": c["dspark_experts"], "dspark_num_experts_per_tok": c["dspark_top_k"],
        "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [c["block"], c["block"]],
                                "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "expert_dtype": "fp4"},
    }
    config = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
              "image_token_id": None, "bos_token_id": 0, "eos_token_id": 1}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- DeepSeek-V4 -------------------------------------------------------------------------------------

V4_SHAPE = dict(vocab=512, dim=128, layers=5, heads=4, head_dim=128, rope=64, q_lora=128, o_groups=4, o_lora=128,
                hc=4, inter=512, experts=8, top_k=2, window=16, ratios=[0, 4, 8, 4, 0], hash_layers=1,
                index_heads=4, index_head_dim=128, index_topk=4, block=128, dspark_targets=[2, 3, 4], markov_rank=32)


def _write_v4(out: Path, seed: int, drafter: str, vocab: int | None) -> None:
    c = dict(V4_SHAPE, vocab=vocab or V4_SHAPE["vocab"])
    if c["vocab"] >= 300:
        write_tokenizer(out / "tokenizer.json", c["vocab"])
        tok = json.loads((out / "tokenizer.json").read_text())
        noise_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<noise>")
    else:  # too small for a byte-level tokenizer: an ids-only model (sampling tests)
        noise_id = c["vocab"] - 1
    w = _Writer(seed, c["block"])
    dim, hc = c["dim"], c["hc"]
    w.dense("embed.weight", c["vocab"], dim, gain=math.sqrt(dim))
    w.dense("head.weight", c["vocab"], dim, gain=2.0)
    w.norm("norm.weight", dim)
    w.f32("hc_head_fn", hc, hc * dim, std=0.5 / math.sqrt(hc * dim))
    w.f32("hc_head_base", hc, std=0.5)
    w.f32("hc_head_scale", 1, std=0.1, mean=1.0)

    def compressor(p, width, overlap, ratio):
        proj = width * (2 if overlap else 1)
        w.dense(f"{p}.wkv.weight", proj, dim)
        w.dense(f"{p}.wgate.weight", proj, dim)
        w.f32(f"{p}.ape", ratio, proj, std=0.5)
        w.norm(f"{p}.norm.weight", width)

    def block(p, ratio, hashed):
        _block_common(w, p, c)
        if ratio:
            compressor(f"{p}.attn.compressor", c["head_dim"], ratio == 4, ratio)
        if ratio == 4:
            compressor(f"{p}.attn.indexer.compressor", c["index_head_dim"], True, ratio)
            w.fp8(f"{p}.attn.indexer.wq_b", c["index_heads"] * c["index_head_dim"], c["q_lora"])
            w.dense(f"{p}.attn.indexer.weights_proj.weight", c["index_heads"], dim)
        _moe(w, f"{p}.ffn", dim, c["inter"], c["experts"], fp4=True, vocab=c["vocab"], top_k=c["top_k"],
             hashed=hashed)

    for L in range(c["layers"]):
        block(f"layers.{L}", c["ratios"][L], L < c["hash_layers"])
    n_stages = 3 if drafter == "dspark" else 1
    for s in range(n_stages):
        block(f"mtp.{s}", 0, False)
    if drafter == "mtp":
        w.fp8("mtp.0.e_proj", dim, dim)
        w.fp8("mtp.0.h_proj", dim, dim)
        w.norm("mtp.0.enorm.weight", dim)
        w.norm("mtp.0.hnorm.weight", dim)
        w.norm("mtp.0.norm.weight", dim)
        w.f32("mtp.0.hc_head_fn", hc, hc * dim, std=0.5 / math.sqrt(hc * dim))
        w.f32("mtp.0.hc_head_base", hc, std=0.5)
        w.f32("mtp.0.hc_head_scale", 1, std=0.1, mean=1.0)
    else:
        w.fp8("mtp.0.main_proj", dim, dim * len(c["dspark_targets"]))
        w.norm("mtp.0.main_norm.weight", dim)
        w.norm("mtp.2.norm.weight", dim)
        w.f32("mtp.2.hc_head_fn", hc, hc * dim, std=0.5 / math.sqrt(hc * dim))
        w.f32("mtp.2.hc_head_base", hc, std=0.5)
        w.f32("mtp.2.hc_head_scale", 1, std=0.1, mean=1.0)
        w.dense("mtp.2.markov_head.markov_w1.weight", c["vocab"], c["markov_rank"], gain=math.sqrt(c["markov_rank"]))
        w.dense("mtp.2.markov_head.markov_w2.weight", c["vocab"], c["markov_rank"], gain=0.5)
        w.dense("mtp.2.confidence_head.proj.weight", 1, dim + c["markov_rank"])
    save_file(w.t, str(out / "model.safetensors"))
    config = {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": c["vocab"],
        "hidden_size": dim, "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": 1, "head_dim": c["head_dim"], "qk_rope_head_dim": c["rope"], "q_lora_rank": c["q_lora"],
        "o_groups": c["o_groups"], "o_lora_rank": c["o_lora"], "rms_norm_eps": 1e-6, "sliding_window": c["window"],
        "compress_ratios": c["ratios"] + [0] * n_stages, "num_hash_layers": c["hash_layers"],
        "index_n_heads": c["index_heads"], "index_head_dim": c["index_head_dim"], "index_topk": c["index_topk"],
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "max_position_embeddings": 4096, "n_routed_experts": c["experts"], "n_shared_experts": 1,
        "num_experts_per_tok": c["top_k"], "moe_intermediate_size": c["inter"], "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": hc,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
        "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [c["block"], c["block"]],
                                "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
    }
    if drafter == "dspark":
        config.update(dspark_block_size=5, dspark_noise_token_id=noise_id, dspark_target_layer_ids=c["dspark_targets"],
                      dspark_markov_rank=c["markov_rank"])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tiny(out_dir, family: str = "deepseek_v41", seed: int = 0, vocab: int | None = None,
               shape: str = "tiny") -> Path:
    """Write a tiny random checkpoint to `out_dir` (created). `deepseek_v4` carries the April MTP head,
    `deepseek_v4_0731` the 3-stage DSpark drafter on the V4 backbone. `vocab` (V4 families only) below 300
    writes an ids-only model without tokenizer.json. `shape="slice"` (V4.1): 4 layers at full width."""
    if shape != "tiny" and family != "deepseek_v41":
        raise ValueError(f"shape {shape!r}: only for deepseek_v41")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if family == "deepseek_v41":
        if vocab is not None:
            raise ValueError("vocab: the V4.1 tiny model keeps its tokenizer (Engram needs it)")
        _write_v41(out, seed, shape)
    elif family == "deepseek_v4":
        _write_v4(out, seed, "mtp", vocab)
    elif family == "deepseek_v4_0731":
        _write_v4(out, seed, "dspark", vocab)
    else:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    return out
