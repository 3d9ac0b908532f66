"""MTP, V4-Flash's (April) one-layer multi-token-prediction head, built from the checkpoint's `mtp.0.*`
tensors: one V4 block fed with the target's final streams and the next token, chained for several drafts.
Its ring holds rows of committed positions only. Same calls as the DSpark drafter (dspark.py)."""

import torch

from .blocks import Dense, Linear, RMSNorm
from .config import ModelConfig
from .deepseek_v4 import HyperHead, PlainBlock, V4Attention, v4_moe
from .runtime import Runtime
from .state import DecodeState, new_state, shifted
from .step import Draft, Step, begin, finish

MAX_DRAFTS = 8  # the most drafts a chain of the one-layer head proposes a cycle (its errors compound)


class MTP:
    """V4-Flash's one-layer MTP head, chained: draft i reads the previous draft's output streams."""

    kind = "mtp"
    commits_ahead = False  # its commit takes each row's next token: a verify's last row waits for the next draft

    def __init__(self, cfg: ModelConfig, ckpt, rt: Runtime, embed: torch.Tensor, head: Dense, plain_rope):
        c = cfg
        self.cfg, self.rt, self.embed, self.head = cfg, rt, embed, head
        self.row_comm = None  # split over ranks on the fast path: a long call's streams held by rows (Step)
        L = c.n_layers  # the head's block is layer n_layers
        blk, ab = c.weight_block, c.act_block
        self.e_proj = Linear.load(rt, ckpt, "mtp.0.e_proj.weight", c.dim, c.dim, blk, ab)
        self.h_proj = Linear.load(rt, ckpt, "mtp.0.h_proj.weight", c.dim, c.dim, blk, ab)
        self.enorm = RMSNorm.load(rt, ckpt, "mtp.0.enorm.weight", c.dim, c.norm_eps)
        self.hnorm = RMSNorm.load(rt, ckpt, "mtp.0.hnorm.weight", c.dim, c.norm_eps)
        self.norm = RMSNorm.load(rt, ckpt, "mtp.0.norm.weight", c.dim, c.norm_eps)
        self.hc_head = HyperHead(rt, c, ckpt, "mtp.0.")
        attn = V4Attention(rt, c, ckpt, L, plain_rope, prefix="mtp.0.attn")
        ffn = v4_moe(rt, c, ckpt, "mtp.0.ffn", c.n_routed_experts, c.n_activated_experts, hashed=False)
        self.block = PlainBlock(rt, c, ckpt, "mtp.0", attn, ffn)

    def new_state(self, capacity: int, spare: int = 16, device=None) -> DecodeState:
        """The decode state for `capacity` positions (`device`: the model's by default; "meta" sizes it
        without allocating)."""
        return new_state(capacity, spare, device or self.rt.device, [self.block.attn])

    @staticmethod
    def rows(out) -> torch.Tensor:
        return out.streams

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.cfg.hc_mult, self.cfg.dim)

    def _inputs(self, streams: torch.Tensor, step: Step) -> torch.Tensor:
        """The step's tokens into the head's history, their embedding rows (one copy: ops.token_inputs) and
        the target's `streams` of them, projected and added."""
        rows = self.rt.ops.token_inputs(step.tokens, step.positions, step.state.tokens, self.embed, 1, self.rt.dtype,
                                        step.share)
        e = self.e_proj(self.enorm(rows[:, 0]))  # [n, D]
        h = self.h_proj(self.hnorm(streams))  # [n, hc, D]
        return (e.unsqueeze(1).to(self.rt.wide) + h.to(self.rt.wide)).to(self.rt.dtype)

    def _forward(self, state, streams, tokens, start) -> torch.Tensor:
        """`start` a host int: eager (must equal the state's length); a device scalar: static. Split over
        ranks, a long call's result holds this rank's share of the rows (model.Step.share)."""
        step = begin(state, tokens, None if isinstance(start, int) else start, "own", comm=self.row_comm)
        Y = self.block(self._inputs(streams[step.share], step), step)
        finish(step)
        return Y

    def commit(self, state: DecodeState, rows: torch.Tensor, tokens_next: torch.Tensor, start: int) -> None:
        """Run the head over positions start.. (target streams `rows`, next tokens) to fill its ring."""
        self._forward(state, rows.to(self.rt.dtype), tokens_next[: rows.shape[0]], start)

    def draft(self, state: DecodeState, q, anchor: torch.Tensor, row_q: torch.Tensor, k: int,
              params: torch.Tensor, key: torch.Tensor, out: Draft | None = None, window=None) -> Draft:
        """Position q from the target's streams and the anchor; then k-1 chained steps at q+1.. . The chained
        steps write ring rows of speculative positions: the caller runs this in a state transaction and
        rolls back from q+1. The draft is written into `out` (a captured cycle's buffers; by default fresh
        ones). `window` is not read: a DSpark drafter's (its stages' window slots); the head's attention
        gathers its window itself."""
        out = out or Draft.empty(k, self.cfg.vocab_size, anchor.device, confidence=False)
        streams, token = row_q.unsqueeze(0).to(self.rt.dtype), anchor
        logits = []
        for i in range(k):
            Y = self._forward(state, streams, token, shifted(q, i))
            li = self.head(self.hc_head.normed(Y, self.norm), torch.float32)
            token = self.rt.ops.sample(li, params, key, out.ids[i:i + 1])
            logits.append(li)
            streams = Y
        torch.cat(logits, out=out.logits)
        return out
