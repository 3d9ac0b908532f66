"""Building blocks shared by the DeepSeek-V4 and V4.1 models: linear layers, norms, mHC sites, the MoE,
the window gather and the grouped output projection. Each block loads its own tensors by official name and
calls its math through the op registry (`rt.ops`), so the reference and fast paths share this code.
"""

import torch

from kernels.linear import PackedWeight

from .runtime import Runtime
from .state import PositionRing
from .weights import Checkpoint


class Linear:
    """A checkpoint linear layer (FP8 / FP4 / dense) with the official activation quantization in front."""

    def __init__(self, rt: Runtime, weight: PackedWeight | None, act_block: int | None):
        self.rt = rt
        self.weight = weight
        self.act_block = act_block if rt.num.official else None

    @classmethod
    def load(cls, rt, ckpt: Checkpoint, name, out_f, in_f, block, act_block):
        return cls(rt, ckpt.linear(name, out_f, in_f, block), act_block)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.rt.ops.linear(x, self.weight, self.act_block, out_dtype or self.rt.dtype)


class Dense:
    """An unquantized product (compressor, index-key and head projections, router, DSpark's heads): no
    activation quantization, one rounding to `out_dtype`. Holds the checkpoint's weight as stored (BF16);
    the fast path's kernels read it so, and only the reference path makes its float64 [in, out] copy (at
    load, as it always did)."""

    def __init__(self, rt: Runtime, weight: PackedWeight | None):
        self.rt, self.weight = rt, weight
        if weight is not None and rt.ops.path == "reference":
            weight.dense64()

    @classmethod
    def load(cls, rt, ckpt: Checkpoint, name, out_f, in_f, block=None):
        return cls(rt, ckpt.linear(name, out_f, in_f, block, kind="dense"))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype, sampled: str = "",
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`sampled`: where the product goes only to samplers' kernels, when they read it (a split head's
        need not be gathered: parallel/sharding.py VocabParallel); one device's is whole either way. `out`:
        the caller's buffer the product is written into (no copy after)."""
        return self.rt.ops.linear(x, self.weight, None, out_dtype, out=out)


class RMSNorm:
    def __init__(self, rt: Runtime, weight: torch.Tensor | None, eps: float):
        self.rt = rt
        self.weight = None if weight is None else weight.float()
        self.eps = eps

    @classmethod
    def load(cls, rt, ckpt, name, dim, eps):
        return cls(rt, ckpt.tensor(name, (dim,)), eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.rt.ops.rmsnorm(x, self.weight, self.eps)


class HyperSite:
    """One mHC site's parameters (`hc_attn_*` or `hc_ffn_*`): fn [hc*(2+hc), hc*D], base, scale [3]."""

    def __init__(self, rt: Runtime, ckpt: Checkpoint, prefix: str, hc: int, dim: int, norm_eps: float,
                 hc_eps: float, iters: int):
        n = hc * (2 + hc)
        self.rt = rt
        self.fn = ckpt.tensor(f"{prefix}_fn", (n, hc * dim), (torch.float32,))
        self.base = ckpt.tensor(f"{prefix}_base", (n,), (torch.float32,))
        self.scale = ckpt.tensor(f"{prefix}_scale", (3,), (torch.float32,))
        self.norm_eps, self.hc_eps, self.iters = norm_eps, hc_eps, iters

    def coeffs(self, X: torch.Tensor):
        return self.rt.ops.hc_coeffs(X, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters)

    def pre(self, X: torch.Tensor, weights: torch.Tensor | None, norm: "RMSNorm",
            capture: bool | torch.Tensor = False):
        """The site's coefficients and its sub-block's input norm(collapse(X, weights)), `weights` None: by
        the site's own pre -> (x, pre, post, comb, the copies' mean if `capture`: kernels/mhc.py `pre`), one
        launch on the fast path."""
        return self.rt.ops.hc_pre(X, weights, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters,
                                  norm.weight, norm.eps, capture)

    def expand_pre(self, y, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, weights: torch.Tensor | None,
                   norm: "RMSNorm", capture: bool | torch.Tensor = False):
        """The previous sub-block's output y (a sum over ranks: its partials; a MoE's not yet combined:
        kernels.mhc.Combine) expanded into the streams X by (post, comb), then this site's `pre` of the result
        -> (X', x, pre, post, comb, the copies' mean if `capture`): one launch on the fast path, the expand
        done where the site reads the streams."""
        return self.rt.ops.hc_expand_pre(y, X, post, comb, weights, self.fn, self.base, self.scale, self.norm_eps,
                                         self.hc_eps, self.iters, norm.weight, norm.eps, capture)


class MoE:
    """Routed experts (FP4 or FP8) + shared expert, score routing (sqrt-softplus + bias) or hash routing."""

    def __init__(self, rt: Runtime, ckpt: Checkpoint, prefix: str, dim: int, inter: int, n_experts: int,
                 top_k: int, score_func: str, route_scale: float, limit: float, weight_block, act_block: int,
                 route_eps: float, vocab_size: int = 0, hashed: bool = False, n_shared: int = 1):
        self.rt = rt
        self.top_k, self.score_func, self.route_scale, self.limit = top_k, score_func, route_scale, limit
        self.route_eps = route_eps
        self.act_block = act_block if rt.num.official else None
        self.gate = Dense.load(rt, ckpt, f"{prefix}.gate.weight", n_experts, dim)
        self.hash_table = None
        self.bias = None
        if hashed:
            self.hash_table = ckpt.tensor(f"{prefix}.gate.tid2eid", (vocab_size, top_k), (torch.int64, torch.int32))
        else:
            self.bias = ckpt.tensor(f"{prefix}.gate.bias", (n_experts,), (torch.float32,))

        def expert(p, kind):
            return (ckpt.linear(f"{p}.w1.weight", inter, dim, weight_block, kind),
                    ckpt.linear(f"{p}.w2.weight", dim, inter, weight_block, kind),
                    ckpt.linear(f"{p}.w3.weight", inter, dim, weight_block, kind))

        self.experts = [expert(f"{prefix}.experts.{e}", "expert") for e in range(n_experts)]
        self.shared = expert(f"{prefix}.shared_experts", "fp8") if n_shared else None
        self.reduce = None  # split over ranks: sums the slots and shared partials (appliance/parallel/sharding.py)

    def expand(self, x: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               tokens: torch.Tensor | None = None, pending: bool = False):
        """The sub-block: route x [T, D] (hash routing by `tokens`), the experts, and the mHC expand of their
        sum into the streams X [T, hc, D] -> X' (four launches on the fast path); `pending`: a decode step's
        on the fast path returns its output before the combine instead (kernels.moe.Pending, for the next
        site's launch: HyperSite.expand_pre), three launches."""
        hash_idx = None if self.hash_table is None else self.hash_table[tokens].long()
        X, _, _ = self.rt.ops.ffn(x, self.gate.weight, self.bias, self.top_k, self.score_func, self.route_scale,
                                  self.route_eps, hash_idx, self.experts, self.shared, self.act_block, self.limit,
                                  self.rt.num.official, X, post, comb, reduce=self.reduce, pending=pending)
        return X


def window_gather(ring: PositionRing, start, keys: torch.Tensor, positions: torch.Tensor,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key set for the window part of attention over a chunk of consecutive positions.

    Returns kv [size + T, d] (the ring's slots, then this chunk's keys) and index [T, window]: for the query
    at p, the rows of kv holding positions p - window + 1 .. p, oldest first (-1 before position 0). The
    list is in position order whether a key sits in the ring or in this chunk, so a query reduces its keys
    in the same order in a verify block as in a single step. The chunk's keys go to the ring only after
    this gather."""
    all_kv = torch.cat((ring.data.to(keys.dtype), keys), dim=0)
    t = positions.unsqueeze(1) - (window - 1) + torch.arange(window, device=positions.device)  # key positions
    row = torch.where(t >= start, ring.size + (t - start), torch.remainder(t, ring.size))
    return all_kv, torch.where(t >= 0, row, -1)


class GroupedOutput:
    """Grouped output projection: heads split into G groups, each projected by its own block of `wo_a`
    (FP8, a plain product: no activation quantization) to the o-LoRA rank, then `wo_b` (FP8,
    activation-quantized) to D."""

    def __init__(self, rt: Runtime, ckpt: Checkpoint, prefix: str, cfg, act_block: int):
        g, r = cfg.o_groups, cfg.o_lora_rank
        in_per_group = cfg.n_heads * cfg.head_dim // g
        # [G r, in_per_group] as stored; the reference path also keeps a float64 [G, in_per_group, r] copy
        self.wo_a = ckpt.linear(f"{prefix}.wo_a.weight", g * r, in_per_group, cfg.weight_block)
        self.groups = g
        if self.wo_a is not None and rt.ops.path == "reference":
            self.wo_a.grouped64(g)
        self.wo_b = Linear.load(rt, ckpt, f"{prefix}.wo_b.weight", cfg.dim, g * r, cfg.weight_block, act_block)
        self.rt = rt

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, H, d] -> the grouped projection u [T, G r]."""
        t = o.shape[0]
        return self.rt.ops.linear(o.reshape(t, -1), self.wo_a, None, self.rt.dtype, groups=self.groups)

    def expand_pre(self, u: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   site: HyperSite, weights: torch.Tensor | None, norm: RMSNorm):
        """wo_b(u) [T, D] added to the residual streams X [T, hc, D] by the mHC expand, then the next site's
        `pre` of them -> (X', x, pre, post, comb). Split over ranks (a decode step on the box), the site's launch
        adds the ranks' partials of wo_b(u) and expands them as it reads the streams (RowParallel.into,
        HyperSite.expand_pre): one launch after the product. Whole, the expand is the product's epilogue, the
        site a launch of its own; split, a long call holds a share of the rows' streams (fewer rows than u:
        Step.share) and takes wo_b whole for those rows (sharding.RowParallel.exchange), as a whole one."""
        wo_b, ops = self.wo_b, self.rt.ops
        if isinstance(wo_b, Linear):
            X = ops.linear_expand(u, wo_b.weight, wo_b.act_block, X, post, comb)
        elif X.shape[0] != u.shape[0]:
            X = ops.linear_expand(wo_b.exchange(u), wo_b.whole, wo_b.act_block, X, post, comb)
        else:
            return wo_b.into(u, lambda y: site.expand_pre(y, X, post, comb, weights, norm)[:5])
        return (X, *site.pre(X, weights, norm)[:4])


def q_renorm(q: torch.Tensor, eps: float, official: bool) -> torch.Tensor:
    """V4's per-head re-normalization of the query. Official: every step rounded to the activation dtype;
    plain: transformers' (fp32 mean and rsqrt, rounded once)."""
    if official:
        dt = q.dtype
        ms = q.square().mean(-1, keepdim=True, dtype=torch.float32).to(dt)
        return q * torch.rsqrt(ms + eps).to(dt)
    return q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + eps).to(q.dtype)


class AttentionProjections:
    """What every attention here (V4, V4.1, the drafters') shares: low-rank queries (wq_a, q_norm, wq_b),
    the one shared key/value head (wkv, kv_norm), a sink logit per head, the grouped output, and the core
    of a forward where the families agree (queries, window keys, the window ring, attention with its
    inverse RoPE and output). A family sets `renorm_q` (V4's per-head query re-normalization) and its KV
    fake quantization (`kv_quant`); what differs (compressed rows, indexers, the drafter's window) stays
    in the family's file."""

    renorm_q = False

    def __init__(self, rt: Runtime, cfg, ckpt: Checkpoint, prefix: str):
        c, p = cfg, prefix
        blk, ab = c.weight_block, c.act_block
        self.wq_a = Linear.load(rt, ckpt, f"{p}.wq_a.weight", c.q_lora_rank, c.dim, blk, ab)
        self.q_norm = RMSNorm.load(rt, ckpt, f"{p}.q_norm.weight", c.q_lora_rank, c.norm_eps)
        self.wq_b = Linear.load(rt, ckpt, f"{p}.wq_b.weight", c.n_heads * c.head_dim, c.q_lora_rank, blk, ab)
        self.wkv = Linear.load(rt, ckpt, f"{p}.wkv.weight", c.head_dim, c.dim, blk, ab)
        self.kv_norm = RMSNorm.load(rt, ckpt, f"{p}.kv_norm.weight", c.head_dim, c.norm_eps)
        self.sink = ckpt.tensor(f"{p}.attn_sink", (c.n_heads,), (torch.float32,))
        self.out = GroupedOutput(rt, ckpt, p, c, ab)
        self.heads = c.n_heads  # the heads this process computes: all, or one rank's share (sharding.py)

    def kv_quant(self, k: torch.Tensor) -> torch.Tensor:
        """The family's fake quantization of window keys (official numerics); none by default."""
        return k

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (c_q [T, q_lora] for the indexers, q [T, heads, head_dim] with RoPE)."""
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(x.shape[0], self.heads, self.cfg.head_dim)
        if self.renorm_q:
            q = q_renorm(q, self.cfg.norm_eps, self.rt.num.official)
        return c_q, self.rt.ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1))

    def window_keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the window keys [T, head_dim]: kv_norm(wkv(x)), RoPE, KV fake quantization."""
        return self.kv_quant(self.rt.ops.rope(self.kv_norm(self.wkv(x)), cos, sin))

    def window(self, step, k: torch.Tensor, ring_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The window keys (the ring's, then this call's) and, per query, the rows it sees in position
        order; then this call's keys go to the ring."""
        ring = step.state.rings[ring_name]
        kv, index = window_gather(ring, step.start, k, step.positions, self.cfg.window_size)
        ring.write(step.positions, k)
        return kv, index

    @property
    def p_dtype(self) -> torch.dtype | None:
        """How the official kernel rounds the attention's unnormalized probabilities (None: not at all)."""
        return self.rt.dtype if self.rt.num.official and self.rt.dtype != torch.float32 else None

    def attend(self, q, kv, window_index, comp_kv, index, cos, sin) -> torch.Tensor:
        """Attention over window keys `kv` (`window_index`: the rows each query sees, by position) and
        compressed rows `comp_kv` (`index`: the rows each query reads, ascending; -1 = none), the sink,
        inverse RoPE on the output, the grouped projection (the block's `out.expand_pre` finishes it)."""
        ops = self.rt.ops
        o = ops.attention(q, kv, window_index, comp_kv, index, self.sink, self.cfg.head_dim**-0.5, self.p_dtype)
        return self.out.project(ops.rope(o, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True))
