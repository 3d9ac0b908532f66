"""DSpark, the block drafter of V4.1 and V4-Flash-0731, built from the checkpoint's `mtp.*` tensors.

One pass of three window-only stages over the block [anchor, noise x 4] proposes base logits for five future
positions at once; a rank-r Markov head then chains them left to right. Each stage keeps a ring of keys
computed from the target's hidden states at committed positions (`m(q) = main_norm(main_proj(H(q)))`, H =
the streams entering the target layers, averaged over the mHC copies). Oracle: the official reference
outputs in tests/data/v41-tiny-a.

A drafter exposes `new_state`, `commit` (ring rows for positions whose next token is known), `draft` (write
the row of the last committed position q, then propose k tokens for q+2..q+1+k given the anchor token for
q+1) and `rows` (what the target's forward output carries for them); mtp.py is the other one.
"""

from dataclasses import dataclass, field

import torch

from kernels.embed import inputs as token_inputs
from kernels.formats import q8_pow2
from kernels.linear import Product

from .blocks import AttentionProjections, Dense, Linear, RMSNorm
from .config import ModelConfig, V41Config
from .deepseek_v4 import HyperHead, PlainBlock, nope_quant, v4_moe
from .deepseek_v41 import StaggeredBlock, final_collapse, moe_for
from .rope import RopeTable
from .runtime import Runtime
from .state import DecodeState, new_state
from .step import Draft, count


@dataclass
class DraftBlock:
    """One DSpark draft: the block's rows sit at positions q+1 .. q+B."""

    state: DecodeState
    positions: torch.Tensor
    tokens: torch.Tensor | None = None  # the block's ids (V4 blocks pass them to the MoE)
    captures: list = field(default_factory=list)
    # what every stage shares, made once a draft: cos/sin of the block's positions (0731's stages; V4.1's
    # read the RoPE tables inside their ops), the ring slots each query attends to (the window's of q, one
    # row for all) and the block rows, every one of which each query attends to too (the attention's second
    # list)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    block_rows: torch.Tensor | None = None

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        """A block's rows are every rank's (a few: never split, model.Step.gather)."""
        return t


class DraftAttention(AttentionProjections):
    """A DSpark stage's attention. Its ring holds keys of committed positions; the block's queries attend
    to the ring's positions max(0, q - W + 1) .. q and to all block rows (bidirectional: row 1 sees rows
    2..4). The window ends at q for every query."""

    def __init__(self, rt: Runtime, cfg: ModelConfig, ckpt, prefix: str, name: str, rope: RopeTable, v4: bool):
        self.rt, self.cfg, self.name, self.rope, self.v4 = rt, cfg, name, rope, v4
        self.renorm_q = v4  # 0731's stages are V4 attention
        super().__init__(rt, cfg, ckpt, prefix)

    def init_state(self, state: DecodeState, spare: int) -> None:
        state.ring(self.name, self.cfg.window_size + spare, self.cfg.head_dim, self.rt.dtype)

    def kv_quant(self, k: torch.Tensor) -> torch.Tensor:
        if not self.rt.num.official:
            return k
        return nope_quant(k, self.cfg.rope_head_dim) if self.v4 else q8_pow2(k, 32).to(k.dtype)

    def write(self, state: DecodeState, x: torch.Tensor, positions: torch.Tensor) -> None:
        """0731: the window keys of x [n, D] into the ring at `positions`."""
        cos, sin = self.rope(positions)
        state.rings[self.name].write(positions, self.window_keys(x, cos, sin))

    def __call__(self, x: torch.Tensor, step: DraftBlock) -> torch.Tensor:
        ring = step.state.rings[self.name]
        if self.v4:
            _, q = self.queries(x, step.cos, step.sin)
            block = self.window_keys(x, step.cos, step.sin)
        else:  # V4.1: the backbone's products and row work (two products, one op for RoPE, norm, quantization)
            ops, dt = self.rt.ops, self.rt.dtype
            ys = ops.linear_multi(x, [Product(self.wq_a.weight, self.wq_a.act_block, dt),
                                      Product(self.wkv.weight, self.wkv.act_block, dt)])
            q, block, _, _ = ops.query_inputs(ys[0], [Product(self.wq_b.weight, self.wq_b.act_block, dt)],
                                              (self.q_norm.weight, self.q_norm.eps), ys[1], step.positions,
                                              self.rope.tables, self.kv_norm.weight, self.kv_norm.eps, ring.data,
                                              False, self.rt.num.official)
        # the ring's window, then every block row (as the attention's second list: the same keys in the same
        # order as the ring and the block concatenated, read where they are)
        if self.v4:
            return self.attend(q, ring.data, step.rows, block, step.block_rows, step.cos, step.sin)
        # V4.1: the output's inverse RoPE inside the attention's launch, from the tables (as the backbone's)
        o = self.rt.ops.attention(q, ring.data, step.rows, block, step.block_rows, self.sink,
                                  self.cfg.head_dim**-0.5, self.p_dtype, step.positions, self.rope.tables)
        return self.out.project(o)


class DSpark:
    """The DSpark block drafter (V4.1 staggered stages; 0731: V4 stages with an hc_head collapse)."""

    kind = "dspark"
    # its commit needs no next token: a verify commits every row it made, the next draft's q among them
    # (appliance/decode/speculator.py `Speculator.ahead`), and a draft after one reads q's key without writing it
    commits_ahead = True

    def __init__(self, cfg: ModelConfig, ckpt, rt: Runtime, embed: torch.Tensor, head: Dense, rope: RopeTable):
        """`rope`: the plain frequencies' table (theta = rope_theta, no YaRN): on V4.1 the backbone's, shared."""
        d = cfg.dspark
        c = cfg
        self.cfg, self.rt, self.embed, self.head, self.rope = cfg, rt, embed, head, rope
        self.v41 = isinstance(cfg, V41Config)
        self.block_size = d.block_size
        # a draft block's ids and streams [B, hc, D]: row 0 the anchor's, written by each draft (its one launch
        # of token inputs); the rows after it the noise token's, constant, made once here (the op's reference)
        self.block_ids = torch.full((d.block_size,), d.noise_token_id, dtype=torch.long, device=rt.device)
        self.block_inputs = token_inputs(self.block_ids, self.block_ids, None, embed, c.hc_mult, rt.dtype)
        n_targets = len(d.target_layer_ids)
        self.main_proj = Linear.load(rt, ckpt, "mtp.0.main_proj.weight", c.dim, c.dim * n_targets,
                                     c.weight_block, c.act_block)
        self.main_norm = RMSNorm.load(rt, ckpt, "mtp.0.main_norm.weight", c.dim, c.norm_eps)
        self.stages = []
        for s in range(d.n_stages):
            p = f"mtp.{s}"
            attn = DraftAttention(rt, c, ckpt, f"{p}.attn", f"dspark.{s}", rope, v4=not self.v41)
            if self.v41:
                ffn = moe_for(rt, c, ckpt, f"{p}.ffn", d.n_routed_experts, d.n_activated_experts)
                self.stages.append(StaggeredBlock(rt, c, ckpt, p, attn, ffn))
            else:
                ffn = v4_moe(rt, c, ckpt, f"{p}.ffn", d.n_routed_experts, d.n_activated_experts, hashed=False)
                self.stages.append(PlainBlock(rt, c, ckpt, p, attn, ffn))
        last = f"mtp.{d.n_stages - 1}"
        self.norm = RMSNorm.load(rt, ckpt, f"{last}.norm.weight", c.dim, c.norm_eps)
        self.hc_head = None if self.v41 else HyperHead(rt, c, ckpt, f"{last}.")
        embed_name, head_name = ("embed", "head") if self.v41 else ("markov_w1", "markov_w2")
        markov = ckpt.tensor(f"{last}.markov_head.{embed_name}.weight", (c.vocab_size, d.markov_rank))
        # the rows each Markov step reads, in float32 of the activation dtype's values: cast once here, not
        # twice a step
        self.markov_embed = None if markov is None else markov.to(rt.dtype).float()
        self.markov_head = Dense.load(rt, ckpt, f"{last}.markov_head.{head_name}.weight", c.vocab_size, d.markov_rank)
        self.confidence = Dense.load(rt, ckpt, f"{last}.confidence_head.proj.weight", 1, c.dim + d.markov_rank)

    def new_state(self, capacity: int, spare: int = 16, device=None) -> DecodeState:
        """The decode state for `capacity` positions (`device`: the model's by default; "meta" sizes it
        without allocating); the RoPE table grows to cover a draft block past the last position."""
        device = device or self.rt.device
        if self.v41 and torch.device(device) == torch.device(self.rt.device):  # not a sizing-only state
            self.rope.ensure(capacity + self.block_size, device)
        return new_state(capacity, spare, device, [stage.attn for stage in self.stages], self.cfg.hc_mult)

    @staticmethod
    def rows(out) -> torch.Tensor:
        """What the drafter needs from a target forward: H, one row per position."""
        return out.hidden

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.cfg.dim * len(self.cfg.dspark.target_layer_ids),)

    def commit(self, state: DecodeState, rows: torch.Tensor, tokens_next: torch.Tensor | None, start) -> None:
        """Ring rows for positions start .. start+n-1 (their H in `rows`). `start` is a host int (eager:
        the state's length advances), or a device scalar or the positions from it (a captured cycle: the host
        counts): step.count.
        `tokens_next` is not written: nothing reads a DSpark state's token history (its stages take a block's
        ids as they are; the target's state keeps the history)."""
        self._commit(state, rows, start, state.following(start, rows.shape[0]))

    def _commit(self, state: DecodeState, rows: torch.Tensor, start, positions: torch.Tensor) -> None:
        """`commit` at `positions` (start .. start+n-1, made by the caller where it has them)."""
        n = rows.shape[0]
        h = self.main_proj(rows.to(self.rt.dtype))
        if self.v41:  # every stage's key projection of m in one launch, m's RMSNorm inside it
            keys = [Product(s.attn.wkv.weight, s.attn.wkv.act_block, self.rt.dtype) for s in self.stages]
            kvs = self.rt.ops.linear_multi(h, keys, (self.main_norm.weight, self.main_norm.eps))
            # every stage's window key (kv_norm, RoPE, the FP8 fake quantization) into its ring: one op
            attns = [s.attn for s in self.stages]
            rings = [state.rings[a.name] for a in attns]
            for ring in rings:
                ring.record(positions)
            self.rt.ops.window_keys(kvs, positions, self.rope.tables, [a.kv_norm.weight for a in attns],
                                    attns[0].kv_norm.eps, [r.data for r in rings], self.rt.num.official)
        else:
            m = self.main_norm(h)
            for stage in self.stages:
                stage.attn.write(state, m, positions)
        count(state, start, n)

    def draft(self, state: DecodeState, q, anchor: torch.Tensor, row_q: torch.Tensor | None, k: int,
              params: torch.Tensor, key: torch.Tensor, out: Draft | None = None, window=None) -> Draft:
        """Write the ring row of position q (from H(q) = row_q; None: it is in the rings already, a verify's or
        `Speculator.catch_up`'s: `commits_ahead`), then propose k tokens after `anchor` [1],
        sampled with `params` / `key` (kernels.sampling), into `out` (a captured cycle's buffers; by default
        fresh ones). `q` may be a device scalar or the positions from q (`DecodeState.following`): no host
        reads; `window`: the stages' ring slots of positions q - W + 1 .. q (oldest first, negative before 0:
        none) where the caller made them (a cycle's host), else made here."""
        c, ops = self.cfg, self.rt.ops
        B = self.block_size
        positions = state.following(q, B + 1)  # q, then the block's q+1 .. q+B
        if row_q is not None:
            self._commit(state, row_q.unsqueeze(0), q, positions[:1])
        # the confidence head's input [k, D + rank]: each draft's x, then its Markov row, written in place
        # (the anchor's by the token inputs below; each Markov step's sampler writes the next one's)
        features = torch.empty(k, c.dim + self.markov_embed.shape[1], dtype=torch.float32, device=anchor.device)
        mu = features[:, c.dim:]
        # the anchor into row 0 of the block's ids and streams (no other launch: the noise rows are made), its
        # Markov row into the features' first
        ops.token_inputs(anchor, state.offsets[:1], self.block_ids, self.embed, c.hc_mult, self.rt.dtype,
                         out=self.block_inputs[:1], also=(self.markov_embed, mu[:1]))
        X, ids = self.block_inputs, self.block_ids
        step = DraftBlock(state, positions[1:], ids)
        if not self.v41:  # V4.1's stages rotate by the tables inside their ops
            step.cos, step.sin = self.rope(step.positions)
        if window is None:  # every stage's ring has the same size
            window = state.rings[self.stages[0].attn.name].window_slots(positions[0])
        step.rows = window.unsqueeze(0).expand(B, -1)  # one row viewed by every query (its reach: W)
        step.block_rows = state.offsets[:B].unsqueeze(0).expand(B, -1)  # one row viewed by every query
        # the block's B rows attend to each other through the stages; past them only the first k go on (the
        # head's base logits, the Markov steps, the confidence): each row's own, as the kernels are batch
        # invariant, so the head reads its weights for k rows and its exchange carries k, not B
        if self.v41:
            pre = state.first_collapse(B, c.hc_mult)
            for stage in self.stages:  # a stage's MoE combined by the next stage's site, the last's by the head's
                X, pre = stage(X, pre, step, fuse=True)
            # the drafts' collapse (the last stage's MoE combined in its launch) into the features, normed
            x = final_collapse(ops, X, pre, slice(0, k), self.norm, features[:, :c.dim])
        else:
            for stage in self.stages:
                X = stage(X, step)
            x = self.hc_head(X[:k])
            features[:, :c.dim].copy_(x)
            x = self.norm(x)
        base = self.head(x, torch.float32, sampled="later")  # [k, V]: the Markov steps' to add
        out = out or Draft.empty(k, c.vocab_size, x.device, confidence=True)
        for i in range(k):  # the Markov chain: strictly sequential
            last = i + 1 == k
            markov = self.markov_head(mu[i:i + 1], torch.float32, sampled="next")  # the sampler's alone
            self.rt.ops.sample_sum(base[i:i + 1], markov, params, key, out.ids[i:i + 1], out.logits[i:i + 1],
                                   None if last else self.markov_embed, None if last else mu[i + 1:i + 2])
        self.confidence(features, torch.float32, out=out.confidence.view(k, 1))
        return out
