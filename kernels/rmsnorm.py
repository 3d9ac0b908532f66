"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), computed in float64 and rounded once to x's dtype (the
official code keeps a float32 interior and rounds once; float64 differs only in the last place)."""

import torch


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x.dtype. Bytes moved: 2 * x bytes + weight bytes."""
    x64 = x.double()
    r = torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    return (weight.double() * (x64 * r)).to(x.dtype)
