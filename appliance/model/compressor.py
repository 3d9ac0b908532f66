"""KV compressors: each group of `ratio` consecutive positions is pooled into one latent row.

For position q the compressor projects kappa = W_kv x and zeta = W_gate x (+ ape[q mod ratio]) in float32.
Group j (positions [j*m, (j+1)*m)) completes while processing position (j+1)*m - 1; its latent is, per
channel, sum_s softmax_s(zeta_s) * kappa_s over the group's slots, rounded to the activation dtype and
normalized. With `overlap` (V4's CSA) the projections are twice as wide, [Ca | Cb], and group j pools 2m
slots: Ca of the previous group's positions and Cb of its own (before position 0: kappa 0, zeta -inf).
Without a gate (V4.1 ratio 1) the latent is kappa itself.

The projections live in a PositionRing indexed by position, so the carry of an unfinished group is simply
the ring's last positions and rewinding needs no snapshot.
"""

import torch

from .blocks import Dense, RMSNorm
from .runtime import Runtime
from .state import DecodeState, PositionRing


class Compressor:
    def __init__(self, rt: Runtime, wkv: Dense, wgate: Dense | None, ape: torch.Tensor | None, norm: RMSNorm,
                 ratio: int, overlap: bool, width: int):
        self.rt, self.wkv, self.wgate, self.ape, self.norm = rt, wkv, wgate, ape, norm
        self.ratio, self.overlap, self.width = ratio, overlap, width
        self.proj_width = width * (2 if overlap else 1)

    def ring(self, state: DecodeState, name: str, spare: int) -> PositionRing:
        """Projections of the positions a pooling can still read: (1 + overlap) groups + `spare`."""
        size = self.ratio * (2 if self.overlap else 1) + spare
        return state.ring(name, size, 2 * self.proj_width, torch.float32)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, 2 * proj_width] float32: kappa | zeta."""
        kappa = self.wkv(x, torch.float32)
        if self.wgate is None:
            zeta = torch.zeros_like(kappa)
        else:
            zeta = self.wgate(x, torch.float32)
            if self.ape is not None:
                zeta = zeta + self.ape[positions % self.ratio]
        return torch.cat((kappa, zeta), dim=-1)

    def pool(self, ring: PositionRing, start: int, proj: torch.Tensor, positions: torch.Tensor):
        """Latent of each row's group (valid where the row completes it) and the completion flags.

        proj: this chunk's projections [T, 2 * proj_width], not yet in the ring."""
        m, w = self.ratio, self.width
        span = m * (2 if self.overlap else 1)
        group_start = (positions // m) * m - (m if self.overlap else 0)
        q = group_start.unsqueeze(1) + torch.arange(span, device=positions.device)  # [T, span]
        in_chunk = q >= start
        from_chunk = proj[(q - start).clamp(0, proj.shape[0] - 1)]
        from_ring = ring.data[torch.remainder(q, ring.size)]
        slots = torch.where(in_chunk.unsqueeze(-1), from_chunk, from_ring)  # [T, span, 2 * proj_width]
        kappa, zeta = slots[..., : self.proj_width], slots[..., self.proj_width:]
        if self.overlap:  # previous group's slots contribute Ca, the own group's slots Cb
            first = torch.arange(span, device=positions.device) < m
            kappa = torch.where(first.view(1, -1, 1), kappa[..., :w], kappa[..., w:])
            zeta = torch.where(first.view(1, -1, 1), zeta[..., :w], zeta[..., w:])
        before_start = (q < 0).unsqueeze(-1)
        kappa = kappa.masked_fill(before_start, 0.0)
        zeta = zeta.masked_fill(before_start, float("-inf"))
        weights = torch.softmax(zeta.to(self.rt.wide), dim=1)
        latent = (weights * kappa.to(self.rt.wide)).sum(1).float().to(self.rt.dtype)
        complete = (positions + 1) % m == 0
        return self.norm(latent), complete
