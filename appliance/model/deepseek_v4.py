"""DeepSeek-V4-Flash (April) and V4-Flash-0731 backbone, reference definition.

Oracle: transformers 5.23 `DeepseekV4ForCausalLM` (with `--numerics plain`, which follows transformers'
arithmetic), and the delta list of spec/deepseek-v4-flash.md for the `official` numerics. Layer kinds:
- window: sliding-window attention only;
- CSA (ratio 4): an overlapping compressor (each row pools 8 positions, [Ca | Cb] halves) and a lightning
  indexer with its own overlapping compressor at index_head_dim; each query attends its top-k rows;
- HCA (ratio 128 in the release): a plain compressor; every visible compressed row is attended.
mHC is not staggered: each sub-block collapses its own input; the final collapse uses `hc_head`.
The first `n_hash_layers` route experts by a token table (`tid2eid`).
"""

import math

import torch

from kernels.formats import q4_e8m0, q8_pow2

from .blocks import AttentionProjections, Dense, HyperSite, Linear, MoE, RMSNorm
from .compressor import Compressor
from .config import V4Config
from .rope import RopeTable, frequencies
from .runtime import Runtime
from .state import DecodeState, new_state
from .step import Output, Step, begin, capture_column, finish
from .weights import Checkpoint


def hadamard(x: torch.Tensor, wide: torch.dtype = torch.float64) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard transform of the last dim, scaled by 1/sqrt(n) (n a power of 2), its
    sums in `wide` (Runtime.wide), rounded once to x's dtype."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    y = x.to(wide)
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y / math.sqrt(n)).to(x.dtype)


def nope_quant(k: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """V4's KV fake quantization: FP8 with power-of-two scales per 64 of the non-RoPE dims; the RoPE dims
    stay in the activation dtype."""
    return torch.cat((q8_pow2(k[..., :-rope_dim], 64).to(k.dtype), k[..., -rope_dim:]), dim=-1)


class V4Attention(AttentionProjections):
    renorm_q = True

    def __init__(self, rt: Runtime, cfg: V4Config, ckpt: Checkpoint, layer: int, rope: RopeTable,
                 prefix: str | None = None):
        """`layer` names the state buffers; `prefix` the tensors (default `layers.{layer}.attn`). Layers past
        the backbone (the MTP head's) are window-only."""
        p = prefix or f"layers.{layer}.attn"
        c = cfg
        self.rt, self.cfg, self.layer, self.rope = rt, cfg, layer, rope
        self.kind = c.layer_kinds[layer] if layer < c.n_layers else "window"
        self.ratio = c.compress_ratios[layer] if layer < c.n_layers else 0
        super().__init__(rt, c, ckpt, p)
        blk, ab = c.weight_block, c.act_block
        self.compressor = self.index_compressor = None
        if self.kind != "window":
            self.compressor = self._compressor(ckpt, f"{p}.compressor", c.head_dim, self.kind == "csa")
        if self.kind == "csa":
            self.index_compressor = self._compressor(ckpt, f"{p}.indexer.compressor", c.index_head_dim, True)
            self.iq = Linear.load(rt, ckpt, f"{p}.indexer.wq_b.weight", c.index_n_heads * c.index_head_dim,
                                  c.q_lora_rank, blk, ab)
            self.weights_proj = Dense.load(rt, ckpt, f"{p}.indexer.weights_proj.weight", c.index_n_heads, c.dim)

    def _compressor(self, ckpt, prefix, width, overlap) -> Compressor:
        c = self.cfg
        proj = width * (2 if overlap else 1)
        return Compressor(
            self.rt,
            Dense.load(self.rt, ckpt, f"{prefix}.wkv.weight", proj, c.dim),
            Dense.load(self.rt, ckpt, f"{prefix}.wgate.weight", proj, c.dim),
            ckpt.tensor(f"{prefix}.ape", (self.ratio, proj), (torch.float32, torch.bfloat16)),
            RMSNorm.load(self.rt, ckpt, f"{prefix}.norm.weight", width, c.norm_eps),
            self.ratio, overlap, width)

    def init_state(self, state: DecodeState, spare: int) -> None:
        c, L, dt = self.cfg, self.layer, self.rt.dtype
        state.ring(f"window.{L}", c.window_size + spare, c.head_dim, dt)
        if self.compressor is not None:
            self.compressor.ring(state, f"compressor.{L}", spare)
            state.row_cache(f"kv.{L}", self.ratio, c.head_dim, dt)
        if self.index_compressor is not None:
            self.index_compressor.ring(state, f"index_compressor.{L}", spare)
            state.row_cache(f"index_keys.{L}", self.ratio, c.index_head_dim, dt)

    # --- numerics (official: FP8 on the 448 non-RoPE dims in blocks of 64; plain: none) ---------------

    def _nope_quant(self, k: torch.Tensor) -> torch.Tensor:
        return nope_quant(k, self.cfg.rope_head_dim) if self.rt.num.official else k

    def _index_quant(self, x: torch.Tensor) -> torch.Tensor:
        return q4_e8m0(hadamard(x, self.rt.wide), 32).to(x.dtype) if self.rt.num.official else x

    def kv_quant(self, k: torch.Tensor) -> torch.Tensor:
        return self._nope_quant(k)

    # --- forward -------------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        L = self.layer
        cos, sin = self.rope(step.positions)
        c_q, q = self.queries(x, cos, sin)
        win_kv, win_index = self.window(step, self.window_keys(x, cos, sin), f"window.{L}")
        comp_kv, comp_index = None, None
        if self.compressor is not None:
            self._compress(x, step, self.compressor, f"compressor.{L}", f"kv.{L}", self._nope_quant)
            comp_kv = step.state.rows[f"kv.{L}"].visible(step.bound)
            if self.kind == "hca":  # every visible row
                n_valid = (step.positions + 1) // self.ratio
                rows = torch.arange(comp_kv.shape[0], device=comp_kv.device)
                comp_index = torch.where(rows.unsqueeze(0) < n_valid.unsqueeze(1), rows.unsqueeze(0), -1)
            else:
                comp_index = self.select_rows(x, c_q, step)
        return self.attend(q, win_kv, win_index, comp_kv, comp_index, cos, sin)

    def _compress(self, x, step: Step, comp: Compressor, ring_name, rows_name, quant) -> None:
        ring = step.state.rings[ring_name]
        proj = comp.project(x, step.positions)
        latent, complete = comp.pool(ring, step.start, proj, step.positions)
        ring.write(step.positions, proj)
        row = step.positions // self.ratio
        cos, sin = self.rope(row * self.ratio)
        cache = step.state.rows[rows_name]
        row_index = torch.where(complete, row, torch.full_like(row, cache.trash))
        cache.write(row_index, quant(self.rt.ops.rope(latent, cos, sin)), step.positions)

    def select_rows(self, x, c_q, step: Step) -> torch.Tensor:
        """The compressed rows each query reads [T, k] (-1 = none): the indexer's keys written, then the
        top-k of its scores."""
        c, L, ops, dt = self.cfg, self.layer, self.rt.ops, self.rt.dtype
        T = x.shape[0]
        self._compress(x, step, self.index_compressor, f"index_compressor.{L}", f"index_keys.{L}",
                       self._index_quant)
        cos, sin = self.rope(step.positions)
        qi = self.iq(c_q).view(T, c.index_n_heads, c.index_head_dim)
        qi = self._index_quant(ops.rope(qi, cos.unsqueeze(1), sin.unsqueeze(1)))
        scale = torch.tensor(c.index_head_dim**-0.5 * c.index_n_heads**-0.5, dtype=torch.float32)
        if self.rt.num.official:
            w = (self.weights_proj(x, dt).float() * scale).to(dt)
        else:
            w = self.weights_proj(x, torch.float32) * scale
        keys = step.state.rows[f"index_keys.{L}"].visible(step.bound)
        scores = ops.index_scores(qi, w, keys, step.positions, self.ratio, dt if self.rt.num.official else None)
        topk, _ = ops.index_select(scores, c.index_topk)
        return topk


class PlainBlock:
    """A V4 block: attention and MoE, each between its own mHC site (not staggered)."""

    def __init__(self, rt: Runtime, cfg, ckpt: Checkpoint, prefix: str, attn, ffn: MoE,
                 captured: tuple[int, int] | None = None):
        """`captured`: this layer's place among DSpark's target layers and their count (step.capture_column;
        None: it is not one)."""
        c = cfg
        self.rt, self.attn, self.ffn, self.captured = rt, attn, ffn, captured
        self.attn_norm = RMSNorm.load(rt, ckpt, f"{prefix}.attn_norm.weight", c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm.load(rt, ckpt, f"{prefix}.ffn_norm.weight", c.dim, c.norm_eps)
        self.hc_attn = HyperSite(rt, ckpt, f"{prefix}.hc_attn", c.hc_mult, c.dim, c.norm_eps, c.hc_eps,
                                 c.hc_sinkhorn_iters)
        self.hc_ffn = HyperSite(rt, ckpt, f"{prefix}.hc_ffn", c.hc_mult, c.dim, c.norm_eps, c.hc_eps,
                                c.hc_sinkhorn_iters)

    def __call__(self, X: torch.Tensor, step) -> torch.Tensor:
        """X [T, hc, D] -> the layer's output streams (split over ranks, a long call's share of the rows:
        v41.StaggeredBlock)."""
        # DSpark (0731) reads the stream entering a captured layer, averaged over the copies (the site writes it
        # into the step's `hidden`)
        mean = step.capture(X, self.captured) if self.captured else False
        x, _, post, comb, _ = self.hc_attn.pre(X, None, self.attn_norm, mean)
        X, x, _, post, comb = self.attn.out.expand_pre(self.attn(step.gather(x), step), X, post, comb, self.hc_ffn,
                                                       None, self.ffn_norm)
        X = self.ffn.expand(step.gather(x), X, post, comb, step.tokens)
        return X


def v4_moe(rt: Runtime, cfg: V4Config, ckpt: Checkpoint, prefix: str, n_experts: int, top_k: int,
           hashed: bool) -> MoE:
    return MoE(rt, ckpt, prefix, cfg.dim, cfg.moe_inter_dim, n_experts, top_k, cfg.score_func, cfg.route_scale,
               cfg.swiglu_limit, cfg.weight_block, cfg.act_block, route_eps=0.0 if rt.num.official else 1e-20,
               vocab_size=cfg.vocab_size, hashed=hashed, n_shared=cfg.n_shared_experts)


class HyperHead:
    """V4's final collapse of the hc copies: sigmoid weights from the stream, no Sinkhorn."""

    def __init__(self, rt: Runtime, cfg, ckpt: Checkpoint, prefix: str):
        c = cfg
        self.rt, self.cfg = rt, cfg
        self.fn = ckpt.tensor(f"{prefix}hc_head_fn", (c.hc_mult, c.hc_mult * c.dim), (torch.float32,))
        self.base = ckpt.tensor(f"{prefix}hc_head_base", (c.hc_mult,), (torch.float32,))
        self.scale = ckpt.tensor(f"{prefix}hc_head_scale", (1,), (torch.float32,))

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        pre = self.rt.ops.hc_head_pre(X, self.fn, self.base, self.scale, self.cfg.norm_eps, self.cfg.hc_eps)
        return self.rt.ops.hc_collapse(X, pre)

    def normed(self, X: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm(self(X)), one launch on the fast path."""
        c = self.cfg
        return self.rt.ops.hc_pre(X, None, self.fn, self.base, self.scale, c.norm_eps, c.hc_eps, 0, norm.weight,
                                  norm.eps)[0]


class V4Model:
    family = "deepseek_v4"

    def __init__(self, cfg: V4Config, ckpt: Checkpoint, rt: Runtime):
        c = cfg
        self.cfg, self.rt = cfg, rt
        self.row_comm = None  # split over ranks on the fast path: a long call's streams are held by rows (Step)
        self.embed = ckpt.tensor("embed.weight", (c.vocab_size, c.dim))
        self.head = Dense.load(rt, ckpt, "head.weight", c.vocab_size, c.dim)
        self.norm = RMSNorm.load(rt, ckpt, "norm.weight", c.dim, c.norm_eps)
        self.hc_head = HyperHead(rt, c, ckpt, "")
        round_to = None if rt.num.official else rt.dtype  # transformers rounds cos/sin to the model dtype
        self.plain_rope = RopeTable(frequencies(c.rope_head_dim, c.rope_theta), round_to)
        self.compressed_rope = RopeTable(frequencies(c.rope_head_dim, c.compress_rope_theta, c.rope_factor,
                                                     c.original_seq_len, c.beta_fast, c.beta_slow), round_to)
        self.layers = []
        for L in range(c.n_layers):
            attn = V4Attention(rt, c, ckpt, L, self.compressed_rope if c.compress_ratios[L] else self.plain_rope)
            ffn = v4_moe(rt, c, ckpt, f"layers.{L}.ffn", c.n_routed_experts, c.n_activated_experts,
                         L < c.n_hash_layers)
            self.layers.append(PlainBlock(rt, c, ckpt, f"layers.{L}", attn, ffn, capture_column(c.dspark, L)))

    def new_state(self, capacity: int, spare: int = 16, device=None) -> DecodeState:
        """The decode state for `capacity` positions (`device`: the model's by default; "meta" sizes it
        without allocating)."""
        return new_state(capacity, spare, device or self.rt.device, [layer.attn for layer in self.layers])

    def embed_tokens(self, step: Step) -> torch.Tensor:
        """The step's tokens into the history; X [n, hc, D]: the embedding rows of its share in hc identical
        copies (one launch: ops.token_inputs)."""
        return self.rt.ops.token_inputs(step.tokens, step.positions, step.state.tokens, self.embed, self.cfg.hc_mult,
                                        self.rt.dtype, step.share)

    def final(self, X: torch.Tensor, rows: slice, step, sampled: str = ""):
        """The logits of the call's `rows` from the final streams (`step`'s share of the rows where split);
        `sampled`: they go only to samplers' kernels, which read them then (the head's, blocks.Dense)."""
        if not step.split:
            return self.head(self.hc_head.normed(X[rows], self.norm), torch.float32, sampled)
        return self.head(step.gather(self.hc_head.normed(X, self.norm))[rows], torch.float32, sampled)

    def forward(self, tokens: torch.Tensor, state: DecodeState, logits: str = "all", index_keys: str = "own",
                keep_streams: bool = False, start: torch.Tensor | None = None, bound: int | None = None,
                sampled: str = "") -> Output:
        """Process `tokens` at positions state.length.. (or `start`.., a device scalar, with no position
        past `bound`) into the state; `sampled`: the logits go only to samplers' kernels (`final`)."""
        step = begin(state, tokens, start, index_keys, bound, self.row_comm)
        X = self.embed_tokens(step)
        for layer in self.layers:
            X = layer(X, step)
        out = self.final(X, slice(-1, None) if logits == "last" else slice(None), step, sampled)
        finish(step)
        return Output(out, step, step.gather(X) if keep_streams else None)
