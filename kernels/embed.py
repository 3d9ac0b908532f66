"""A forward's token inputs: its ids written into the token history at their positions, and their embedding
rows in `copies` identical residual streams (mHC: X [T, hc, D]).

inputs: history[positions] = tokens (where a history is given); X = table[tokens[share]] in every copy,
    converted to the streams' dtype (round to nearest even where it narrows). A call split over ranks by
    rows (appliance/model/rowsplit.py) embeds its share of the rows and writes every row's id. `also`
    (table2, out2): another table's rows of the same tokens copied as they are into out2 (DSpark's Markov
    embedding of its anchor, in the launch that embeds the anchor).

Kernel (`fast_inputs`): one launch, a program per row and block of columns; the history by the row's first
block. Exact: a copy and one conversion. The ids are in range (the engine checks a request's; the samplers
make the rest): an id is not checked on the device.
"""

import torch

from ._triton import dependent_launch, pdl, pow2, require, require_dtype, round_out, tl, triton


def inputs(tokens: torch.Tensor, positions: torch.Tensor, history: torch.Tensor | None, table: torch.Tensor,
           copies: int, dtype: torch.dtype, share: slice = slice(None), out: torch.Tensor | None = None,
           also: tuple[torch.Tensor, torch.Tensor] | None = None):
    """tokens, positions int64 [T]; history int64 [capacity] or None; table [V, D] -> X [n, copies, D] in
    `dtype` for the rows `share` of tokens (written into `out` where given); `also` (table2 [V, W], out2
    [n, W] of its dtype, rows of any stride): out2 = table2[tokens[share]]."""
    if history is not None:
        history[positions] = tokens
    if also is not None:
        also[1].copy_(also[0][tokens[share]])
    rows = table[tokens[share].unsqueeze(1).expand(-1, copies)].to(dtype)
    if out is None:
        return rows
    out.copy_(rows)
    return out


@triton.jit(do_not_specialize=["lo", "hi"])
def _inputs_kernel(tok_ptr,    # int64 [T] ids
                   pos_ptr,    # int64 [T] their positions (HISTORY)
                   hist_ptr,   # int64 token history, written at the positions (HISTORY)
                   table_ptr,  # [V, D] embedding rows, row stride stride_t
                   out_ptr,    # [hi - lo, COPIES, D] out, contiguous
                   t2_ptr,     # [V, W] a second table (ALSO), contiguous
                   o2_ptr,     # [hi - lo, W] its rows out (ALSO), row stride stride_o2
                   lo, hi, D, stride_t, W, stride_o2,
                   COPIES: tl.constexpr, HISTORY: tl.constexpr, OUT_BF16: tl.constexpr, ALSO: tl.constexpr,
                   BD: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    tok = tl.load(tok_ptr + t)
    if HISTORY:
        if j == 0:
            tl.store(hist_ptr + tl.load(pos_ptr + t), tok)
    if (t >= lo) & (t < hi):
        cols = j * BD + tl.arange(0, BD)
        mask = cols < D
        # through float32 (exact from bfloat16), rounded once to the streams' dtype
        row = round_out(tl.load(table_ptr + tok * stride_t + cols, mask=mask).to(tl.float32), OUT_BF16)
        base = out_ptr + (t - lo).to(tl.int64) * COPIES * D
        for c in tl.static_range(COPIES):
            tl.store(base + c * D + cols, row, mask=mask)
        if ALSO:  # the same columns of the second table's row, as they are
            m2 = cols < W
            tl.store(o2_ptr + (t - lo).to(tl.int64) * stride_o2 + cols, tl.load(t2_ptr + tok * W + cols, mask=m2),
                     mask=m2)


def fast_inputs(tokens: torch.Tensor, positions: torch.Tensor, history: torch.Tensor | None, table: torch.Tensor,
                copies: int, dtype: torch.dtype, share: slice = slice(None), out: torch.Tensor | None = None,
                also: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The kernel for `inputs` (same signature and result)."""
    require(tokens.dim() == 1 and tokens.is_contiguous(), "tokens.shape", tuple(tokens.shape),
            "must be a contiguous [T]")
    require_dtype(tokens, "tokens", (torch.int64,))
    T = tokens.numel()
    if history is not None:
        require(tuple(positions.shape) == (T,), "positions.shape", tuple(positions.shape), f"must be ({T},)")
        require_dtype(positions, "positions", (torch.int64,))
        require_dtype(history, "history", (torch.int64,))
        require(history.is_contiguous(), "history.stride", history.stride(), "must be contiguous")
    require(table.dim() == 2 and table.stride(1) == 1, "table.shape", tuple(table.shape),
            "must be [V, D] with contiguous rows")
    require_dtype(table, "table", (torch.float32, torch.bfloat16))
    require(dtype in (torch.float32, torch.bfloat16), "dtype", dtype, "must be float32 or bfloat16")
    lo, hi, _ = share.indices(T)
    d = table.shape[1]
    shape = (hi - lo, copies, d)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=tokens.device)
    require(tuple(out.shape) == shape and out.dtype == dtype and out.is_contiguous(), "out",
            (tuple(out.shape), out.dtype), f"must be a contiguous {shape} {dtype}")
    t2, o2 = also if also is not None else (table, out)
    w = t2.shape[1] if also is not None else 0
    if also is not None:
        require(t2.dim() == 2 and t2.is_contiguous(), "also[0].shape", tuple(t2.shape), "must be a contiguous [V, W]")
        require(o2.dim() == 2 and tuple(o2.shape) == (hi - lo, w) and o2.dtype == t2.dtype and o2.stride(1) == 1,
                "also[1]", (tuple(o2.shape), o2.dtype), f"must be [{hi - lo}, {w}] {t2.dtype} with contiguous rows")
    bd = min(pow2(max(d, w)), 1024)
    _inputs_kernel[(T, triton.cdiv(max(d, w), bd))](tokens, positions if history is not None else tokens,
                                                    history if history is not None else tokens, table, out, t2, o2,
                                                    lo, hi, d, table.stride(0), w, o2.stride(0), COPIES=copies,
                                                    HISTORY=history is not None, OUT_BF16=dtype == torch.bfloat16,
                                                    ALSO=also is not None, BD=bd, **pdl(tokens.device))
    return out
