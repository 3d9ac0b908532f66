"""A test drafter that proposes what the target itself would choose (it runs the target model on its own
state): greedy drafts the target accepts unless corrupted, sampled drafts drawn from the target's own
distribution (so every one is accepted)."""

import random

import torch

from appliance.drafters import Draft
from appliance.state import DecodeState
from kernels import sampling as sampler


class OracleDrafter:
    kind = "oracle"

    def __init__(self, lm, target_state: DecodeState, corrupt: float = 0.0, seed: int = 0):
        self.model, self.cfg = lm.model, lm.cfg
        self.target_state = target_state  # the target's committed tokens
        self.corrupt, self.rng = corrupt, random.Random(seed)
        self.mstate = self.model.new_state(target_state.capacity, target_state.spare)

    def new_state(self, capacity, spare):
        return DecodeState(capacity, spare, torch.device("cpu"))  # bookkeeping only

    @staticmethod
    def rows(out):
        return out.logits

    def commit(self, state, rows, tokens_next, start):
        state.advance(tokens_next[: rows.shape[0]])

    def draft(self, state, q, anchor, row_q, k, temperature, top_k=0, top_p=1.0, generator=None):
        state.advance(torch.tensor([anchor]))
        history = self.target_state.tokens[: q + 1].tolist() + [anchor]
        self.mstate.reset()
        logits = self.model.forward(torch.tensor(history), self.mstate, logits="last").logits[-1]
        ids, rows = [], []
        for _ in range(k):
            rows.append(logits)
            token = int(sampler.sample(logits.unsqueeze(0), temperature, top_k, top_p, generator)[0])
            if temperature == 0 and self.rng.random() < self.corrupt:
                token = (token + 1 + self.rng.randrange(self.cfg.vocab_size - 1)) % self.cfg.vocab_size
            ids.append(token)
            logits = self.model.forward(torch.tensor([token]), self.mstate, logits="last").logits[-1]
        return Draft(ids, torch.stack(rows))
