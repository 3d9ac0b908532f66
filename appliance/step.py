"""One forward call of a model over T consecutive tokens, and what it returns."""

from dataclasses import dataclass, field

import torch

from .state import DecodeState


@dataclass
class Step:
    """One forward call: T consecutive tokens starting at position `start`."""

    state: DecodeState
    tokens: torch.Tensor  # [T] int64
    start: int
    positions: torch.Tensor  # [T] int64
    index_keys: str  # "own" | "reference"
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [T, k] rows (-1 = none)
    candidates: torch.Tensor | None = None  # [T, N] bool, from the candidate source
    captures: list[torch.Tensor] = field(default_factory=list)  # DSpark inputs, one [T, D] per target layer
    probe: dict | None = None  # optional per-layer dumps (engram ids, kept rows)

    @property
    def bound(self) -> int:
        return self.start + self.tokens.numel() - 1

    @property
    def decode_call(self) -> bool:
        """A single-token call after the prompt: where the released code's index-key quirk shows."""
        return self.tokens.numel() == 1 and self.start > 0


@dataclass
class Output:
    logits: torch.Tensor  # [R, V] float32 (R = T, or 1 with logits="last")
    hidden: torch.Tensor | None  # [T, n_targets * D]: DSpark inputs (captured target-layer streams)
    streams: torch.Tensor | None = None  # [T, hc, D] final residual streams (V4's MTP head reads them)
