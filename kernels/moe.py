"""Mixture of experts for a few rows: router and expert combination.

route: logits = x . W_gate (float32 from a float64 product); scores = sqrt(softplus) | sigmoid | softmax;
    indices = top-k of (scores + bias) (or the hash table's row), weights = scores[idx] / (sum + eps) * scale.
experts: per row and selected expert e (SwiGLU with clamps):
    g = w1_e(x), u = w3_e(x)  (activation-quantized GEMMs, rounded to the activation dtype)
    h = silu(min(g, limit)) * clamp(u, -limit, limit)        (float32)
    official: o_e = w2_e(round(weight_e * h)), y = sum over experts in increasing id (float32) + shared
    plain:    o_e = w2_e(round(h)) * weight_e (transformers' order)
Each selected expert's weights are read once, however many rows chose it.
"""

import torch
import torch.nn.functional as F

from . import linear


def route(x: torch.Tensor, gate64: torch.Tensor, bias: torch.Tensor | None, top_k: int, score_func: str,
          route_scale: float, norm_eps: float, hash_idx: torch.Tensor | None = None):
    """x [M, D]; gate64 float64 [D, E] -> (weights float32 [M, k], indices int64 [M, k])."""
    logits = torch.matmul(x.double(), gate64).float()
    if score_func == "sqrtsoftplus":
        s = F.softplus(logits).sqrt()
    elif score_func == "sigmoid":
        s = torch.sigmoid(logits)
    else:
        s = torch.softmax(logits, dim=-1)
    if hash_idx is not None:
        idx = hash_idx
    else:
        biased = s if bias is None else s + bias.float()
        idx = biased.topk(top_k, dim=-1).indices
    w = s.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + norm_eps) * route_scale
    return w, idx


def _swiglu(x, w1, w3, act_block, limit, dtype):
    g = linear.reference(x, w1, act_block, dtype).float()
    u = linear.reference(x, w3, act_block, dtype).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


def expert_reference(x: torch.Tensor, w1, w2, w3, act_block: int | None, limit: float,
                     weight: torch.Tensor | None, weight_before_w2: bool) -> torch.Tensor:
    """One SwiGLU expert on rows x [n, D] (PackedWeight w1, w3 [I, D], w2 [D, I]) -> [n, D] in x.dtype."""
    h = _swiglu(x, w1, w3, act_block, limit, x.dtype)
    if weight is not None and weight_before_w2:
        h = weight.unsqueeze(-1) * h
    o = linear.reference(h.to(x.dtype), w2, act_block, x.dtype)
    if weight is not None and not weight_before_w2:
        o = o * weight.unsqueeze(-1).to(o.dtype)
    return o


def reference(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts, shared,
              act_block: int | None, limit: float, weight_before_w2: bool) -> torch.Tensor:
    """x [M, D]; weights/indices [M, k]; experts: list of (w1, w2, w3) (None for experts not held);
    shared: (w1, w2, w3) or None -> y [M, D] in x.dtype.

    Bytes moved: each distinct selected expert's w1, w2, w3 once + x + y."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    order = indices.argsort(dim=-1)  # each row adds its experts in increasing id, like the official loop
    sorted_idx = indices.gather(-1, order)
    sorted_w = weights.gather(-1, order)
    outputs = torch.zeros(*indices.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    for e in sorted_idx.unique().tolist():
        rows, slots = (sorted_idx == e).nonzero(as_tuple=True)
        w1, w2, w3 = experts[e]
        o = expert_reference(x[rows], w1, w2, w3, act_block, limit, sorted_w[rows, slots], weight_before_w2)
        outputs[rows, slots] = o.float()
    for slot in range(indices.shape[-1]):
        y = y + outputs[:, slot]
    if shared is not None:
        y = y + expert_reference(x, *shared, act_block, limit, None, weight_before_w2).float()
    return y.to(x.dtype)
