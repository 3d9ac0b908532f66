"""A test drafter that proposes what the target itself would choose (it runs the target model on its own
state): greedy drafts the target accepts unless corrupted, sampled drafts drawn from the target's own
distribution (so every one is accepted). It reads host values, so it runs with the eager runner only."""

import random

import torch

from appliance.model.state import DecodeState, given_positions
from appliance.model.step import Draft
from kernels import sampling as sampler


class OracleDrafter:
    kind = "oracle"
    commits_ahead = False  # its draft writes q's row itself, like MTP's

    def __init__(self, lm, corrupt: float = 0.0, seed: int = 0):
        self.model, self.cfg, self.rt = lm.model, lm.cfg, lm.runtime
        self.corrupt, self.rng = corrupt, random.Random(seed)
        self.row_shape = (self.cfg.vocab_size,)
        self.target_state = self.mstate = None

    def bind(self, target_state: DecodeState) -> None:
        """Read the target's committed tokens from `target_state` (the session's, once it exists)."""
        self.target_state = target_state
        self.mstate = self.model.new_state(target_state.capacity, target_state.spare)

    def new_state(self, capacity, spare, device=None):
        return DecodeState(capacity, spare, torch.device("cpu"))  # bookkeeping only

    @staticmethod
    def rows(out):
        return out.logits

    def commit(self, state, rows, tokens_next, start):
        n = rows.shape[0]
        positions = state.following(start, n)
        state.journal_tokens(positions)
        state.tokens[positions] = tokens_next[:n]
        if isinstance(start, int):
            state.advance(n)

    def draft(self, state, q, anchor, row_q, k, params, key, out=None, window=None):
        q = int(q[0] if given_positions(q) else q)  # a cycle's: its positions from q
        self.commit(state, row_q.unsqueeze(0), anchor, torch.tensor(q))
        history = torch.cat((self.target_state.tokens[: q + 1], anchor))
        self.mstate.reset()
        logits = self.model.forward(history, self.mstate, logits="last").logits
        ids, rows = [], []
        for _ in range(k):
            rows.append(logits)
            token = sampler.sample(logits, params, key)
            if float(params[0]) == 0 and self.rng.random() < self.corrupt:
                token = (token + 1 + self.rng.randrange(self.cfg.vocab_size - 1)) % self.cfg.vocab_size
            ids.append(token)
            logits = self.model.forward(token, self.mstate, logits="last").logits
        out = out or Draft.empty(k, self.cfg.vocab_size, anchor.device, confidence=False)
        torch.cat(ids, out=out.ids)
        torch.cat(rows, out=out.logits)
        return out
