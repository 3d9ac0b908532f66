"""Sparse decode attention with an attention sink, one shared KV head (K = V).

Each query row m attends to (a) the window keys `window_kv[j]` where `window_mask[m, j]`, and (b) the
compressed rows `comp_kv[comp_index[m, i]]` for valid indices (>= 0). Per head h:
    l_j = (q_h . k_j) * scale;  M = max_j l_j;  P_j = exp(l_j - M);  Z = sum_j P_j + exp(sink_h - M)
    o_h = (sum_j P_j v_j) / Z
The reference accumulates in float64 (the order of rows in the key set then does not matter) and
rounds once; `p_dtype` rounds the unnormalized P before the PV product, as the official bf16 kernel does.
"""

import torch


def reference(q: torch.Tensor, window_kv: torch.Tensor, window_mask: torch.Tensor,
              comp_kv: torch.Tensor | None, comp_index: torch.Tensor | None, sink: torch.Tensor, scale: float,
              p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [M, H, d]; window_kv [Nw, d]; window_mask [M, Nw] bool; comp_kv [Nc, d]; comp_index [M, K] int64
    (-1 = none); sink [H] -> o [M, H, d] in q.dtype.

    Bytes moved: q + o + window_kv once + K gathered rows per query (d elements each)."""
    q64 = q.double()
    kw = window_kv.double()
    logits = torch.einsum("mhd,nd->mhn", q64, kw) * scale
    logits = logits.masked_fill(~window_mask.unsqueeze(1), float("-inf"))
    values = [kw.expand(q.shape[0], -1, -1)]
    if comp_index is not None and comp_index.shape[-1] > 0:
        valid = comp_index >= 0
        rows = comp_kv.double()[comp_index.clamp(min=0)]  # [M, K, d]
        lc = torch.einsum("mhd,mkd->mhk", q64, rows) * scale
        logits = torch.cat((logits, lc.masked_fill(~valid.unsqueeze(1), float("-inf"))), dim=-1)
        values.append(rows)
    v = torch.cat(values, dim=1)  # [M, Nw + K, d]
    mx = logits.amax(-1, keepdim=True).clamp(min=-1e30)
    p = torch.exp(logits - mx)
    z = p.sum(-1, keepdim=True) + torch.exp(sink.double().view(1, -1, 1) - mx)
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    o = torch.einsum("mhn,mnd->mhd", p, v) / z
    return o.to(q.dtype)
