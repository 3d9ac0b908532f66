"""RoPE frequency tables, as the official code builds them (float32 throughout).

f_i = 1 / theta^(2i/r); with YaRN (compressed layers) the pairs between the correction bounds are blended
towards f_i / factor: f'_i = f_i / factor * ramp_i + f_i * (1 - ramp_i). No attention/mscale factor.
The angle for position p is fl32(p * f_i); cos and sin are float32.
"""

import math

import torch

from kernels.rope import table


def frequencies(rope_dim: int, theta: float, factor: float = 1.0, original_seq_len: int = 65536,
                beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """float32 [rope_dim / 2] inverse frequencies (YaRN when factor != 1)."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if factor == 1.0:
        return freqs

    def correction_dim(rotations):
        return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


class RopeTable:
    """cos/sin for any position, computed on demand from the float32 frequencies."""

    def __init__(self, freqs: torch.Tensor, round_to: torch.dtype | None = None):
        self.freqs = freqs
        self.round_to = round_to  # transformers rounds cos/sin to the activation dtype
        self._last: tuple | None = None  # (positions, cos, sin): every layer of a step asks for the same
        # (cos, sin) of every position below the longest state made so far, as the official code precomputes
        # them: the fused ops read rows of these tables (kernels: no transcendental function, no float64
        # slow path). Grown only by `ensure` (a state's construction, before any graph is captured).
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def bytes_per_position(self) -> int:
        """What the tables hold per position (cos and sin, float32)."""
        return 2 * self.freqs.numel() * 4

    def ensure(self, positions: int, device) -> None:
        """The tables hold positions [0, positions) on `device` (4 r bytes per position: 256 MB for V4.1's
        1M positions at r = 64)."""
        if self.tables is None or self.tables[0].shape[0] < positions or self.tables[0].device != torch.device(device):
            self.tables = self._compute(torch.arange(positions, device=device))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [...] -> cos, sin float32 [..., r/2]."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        cos, sin = self._compute(positions)
        self._last = (positions, cos, sin)
        return cos, sin

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = table(positions, self.freqs)
        if self.round_to is not None:
            cos, sin = cos.to(self.round_to).float(), sin.to(self.round_to).float()
        return cos, sin
