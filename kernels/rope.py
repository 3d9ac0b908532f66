"""Rotary embedding on the last `2 * cos.shape[-1]` dims of a vector, as interleaved pairs
(x[2i], x[2i+1]) rotated by angle phi_i; the inverse rotation uses the conjugate. Computed in float64
from float32 cos/sin tables and rounded once to x's dtype."""

import torch


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., d]; cos, sin broadcastable to x[..., :r/2] -> [..., d] in x.dtype (nope dims untouched)."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:].double().unflatten(-1, (r // 2, 2))
    c, s = cos.double(), sin.double()
    if inverse:
        s = -s
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)
