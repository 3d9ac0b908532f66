"""Manifold-constrained hyper-connections (mHC): the residual is `hc` copies X [M, hc, D].

coeffs: from one site's parameters (fn [hc*(2+hc), hc*D], base, scale [3]) compute
    m = (fn . flatten(X)) * rsqrt(mean(X^2) + norm_eps)
    pre  = sigmoid(m[:hc] * scale0 + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[hc:2hc] * scale1 + base[hc:2hc])
    comb = Sinkhorn(m[2hc:] * scale2 + base[2hc:] as hc x hc): row softmax + eps, column normalization,
           then (iters - 1) x (row, column) normalizations.
collapse: x = sum_j pre_j X_j.   expand: X'_k = post_k y + sum_j comb[j, k] X_j (comb transposed).
All interior arithmetic in float64, coefficients returned as float32, streams rounded once.
"""

import torch


def coeffs(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [M, hc, D] -> pre [M, hc], post [M, hc], comb [M, hc, hc] (float32).
    Bytes moved: X once + fn (hc*(2+hc) x hc*D float32)."""
    hc = X.shape[-2]
    v = X.flatten(-2).double()
    rho = torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    m = torch.matmul(v, fn.double().t()) * rho
    m = m.float().double()  # the projection is an fp32 tensor in the official code
    s = scale.double()
    b = base.double()
    pre = torch.sigmoid(m[..., :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    c = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre.float(), post.float(), c.float()


def head_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
             hc_eps: float) -> torch.Tensor:
    """V4's final `hc_head` collapse weights: pre = sigmoid(m * scale + base) + eps, no Sinkhorn."""
    v = X.flatten(-2).double()
    rho = torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    m = (torch.matmul(v, fn.double().t()) * rho).float().double()
    return (torch.sigmoid(m * scale.double()[0] + base.double()) + hc_eps).float()


def collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """X [M, hc, D], pre [M, hc] -> [M, D] in X.dtype."""
    return (pre.double().unsqueeze(-1) * X.double()).sum(-2).to(X.dtype)


def expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [M, D] (sub-block output), X [M, hc, D] -> [M, hc, D] in X.dtype."""
    mixed = torch.matmul(comb.double().transpose(-1, -2), X.double())
    return (post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + mixed).to(X.dtype)
