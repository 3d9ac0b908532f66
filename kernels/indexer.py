"""Lightning-indexer scoring and top-k selection of compressed rows.

scores: s[m, t] = sum_h w[m, h] * relu(q[m, h] . K[t]) for rows t < n_valid[m], -inf elsewhere.
`round_dtype` reproduces the official precision: the dot, the relu-weight product and the head sum are
each rounded to that dtype (bf16 on the device; the activation dtype in general). None = one rounding.
select: the k' = min(k, n_valid) largest scores, indices ascending, -1 in unused slots. Exact ties (the
ReLU makes zero scores common) go to the lower row index, whatever the length of the row: a query selects
the same rows in a prefill chunk, a verify block or a single decode step.
"""

import torch


def scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
           round_dtype: torch.dtype | None) -> torch.Tensor:
    """q [M, nh, dI], w [M, nh] (already scaled), keys [N, dI], n_valid [M] -> float32 [M, N].
    Bytes moved: keys once (N x dI) + q + w + the [M, N] scores."""
    d = torch.einsum("mhd,nd->mhn", q.double(), keys.double())
    if round_dtype is not None:
        d = d.to(round_dtype).double()
        u = (torch.relu(d) * w.double().unsqueeze(-1)).to(round_dtype).double()
        s = u.sum(1).to(round_dtype).float()
    else:
        s = (torch.relu(d) * w.double().unsqueeze(-1)).sum(1).float()
    t = torch.arange(keys.shape[0], device=keys.device)
    return s.masked_fill(t.unsqueeze(0) >= n_valid.unsqueeze(1), float("-inf"))


def select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [M, N] (-inf = not selectable) -> int64 [M, min(k, N)] ascending, -1 for -inf picks."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    idx = _top(scores, k)
    val = scores.gather(-1, idx)
    idx = idx.masked_fill(val == float("-inf"), -1)
    big = torch.iinfo(torch.long).max
    idx = torch.where(idx < 0, big, idx).sort(-1).values
    return idx.masked_fill(idx == big, -1)


def candidate_mask(scores: torch.Tensor, n_valid: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """V4.1 level one: per row, keep the `top_blocks` blocks of `block` rows with the highest max score
    (the newest block, possibly partial, always kept); returns bool [M, N] over the kept blocks' rows."""
    m, n = scores.shape
    n_blocks = -(-n // block)
    padded = torch.full((m, n_blocks * block), float("-inf"), device=scores.device)
    padded[:, :n] = scores
    bs = padded.view(m, n_blocks, block).amax(-1)
    last = torch.div(n_valid - 1, block, rounding_mode="floor").clamp(min=0)
    bs = bs.scatter(1, last.unsqueeze(1), float("inf"))
    real_blocks = torch.arange(n_blocks, device=scores.device).unsqueeze(0) <= last.unsqueeze(1)
    bs = bs.masked_fill(~real_blocks | (n_valid.unsqueeze(1) == 0), float("-inf"))
    k = min(top_blocks, n_blocks)
    idx = _top(bs, k)
    val = bs.gather(-1, idx)
    keep = torch.zeros(m, n_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, idx, val > float("-inf"))
    return keep.repeat_interleave(block, dim=1)[:, :n]


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
