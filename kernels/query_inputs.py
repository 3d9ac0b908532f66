"""The query products of an attention and its row work in one launch: `reference` is kernels/linear.py's
`reference_multi` of q_norm(c_q) (the queries, and the index queries on an index-source layer) followed by
kernels/attn_inputs.py's `reference` (RoPE of the queries, the window key's RMSNorm, RoPE, FP8 fake
quantization and ring write, the index queries' RoPE and FP4, the index head weights scaled).

Kernel (`fast`): the products' launch (kernels/linear.py `launch` with attn_inputs' `QueryRows`): the program
that stores a tile of queries rotates it in place, and of index queries also quantizes it, after a barrier of
its own threads (it reads back what it stored: no other program's output); more programs, one a row, write
the rows' window keys from the window key projection (the launch before's output). The arithmetic is
attn_inputs.fast's, element by element: the same bits as the products' launch followed by attn_inputs'. A long
call (prefill) launches them apart: its products may take two launches (kernels/linear.py `native_split`).
"""

import torch

from . import attn_inputs, linear
from ._triton import in_long_calls, require, require_dtype, require_rows
from .linear import Product


def reference(x: torch.Tensor, products: list[Product], norm: tuple[torch.Tensor, float], kv: torch.Tensor,
              positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_norm: torch.Tensor, eps: float,
              ring: torch.Tensor, write: bool, quant: bool, index_heads: int = 0, iw: torch.Tensor | None = None,
              iw_scale: float = 1.0):
    """x [T, K] (c_q), products: the queries' [H hd] (and, index_heads, the index queries' [nh dI]) of
    RMSNorm(x) by `norm`; kv [T, hd] the window key projection -> attn_inputs' (q [T, H, hd], k [T, hd], qi
    [T, nh, dI], w [T, nh]) (qi, w None without index heads); the other arguments as attn_inputs.reference's."""
    q, qi = _queries(linear.reference_multi(x, products, norm), kv, index_heads)
    return attn_inputs.reference(q, kv, positions, rope, kv_norm, eps, ring, write, quant, qi, iw, iw_scale)


def _queries(ys: list[torch.Tensor], kv: torch.Tensor, index_heads: int) -> tuple:
    """The products' outputs as (q [T, H, hd], qi [T, nh, dI] or None) for attn_inputs."""
    t, hd = kv.shape
    return ys[0].view(t, -1, hd), ys[1].view(t, index_heads, -1) if index_heads else None


def fast(x: torch.Tensor, products: list[Product], norm: tuple[torch.Tensor, float], kv: torch.Tensor,
         positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_norm: torch.Tensor, eps: float,
         ring: torch.Tensor, write: bool, quant: bool, index_heads: int = 0, iw: torch.Tensor | None = None,
         iw_scale: float = 1.0):
    """The kernel for `reference` (same signature and results as linear.fast_multi then attn_inputs.fast):
    one launch, two in a long call."""
    require(len(products) == 1 + bool(index_heads), "products", len(products),
            "must be the queries' (and, with index heads, the index queries')")
    if in_long_calls():
        q, qi = _queries(linear.fast_multi(x, products, norm), kv, index_heads)
        return attn_inputs.fast(q, kv, positions, rope, kv_norm, eps, ring, write, quant, qi, iw, iw_scale)
    require_dtype(kv, "kv", (torch.float32, torch.bfloat16))
    require(kv.dim() == 2 and kv.shape[0] == x.shape[0] and x.dim() == 2, "kv.shape", tuple(kv.shape),
            f"must be [{x.shape[0]}, hd] beside x [T, K]")
    t, hd = kv.shape
    dt = products[0].out_dtype
    require(kv.dtype == dt and all(p.out_dtype == dt for p in products), "products", [p.out_dtype for p in products],
            f"must all be the window key's dtype {kv.dtype}")
    require(products[0].weight.shape[0] % hd == 0, "products[0].weight.shape[0]", products[0].weight.shape[0],
            f"must be whole query heads of {hd}")
    require(tuple(positions.shape) == (t,) and positions.dtype == torch.int64, "positions",
            f"{tuple(positions.shape)} {positions.dtype}", f"must be [{t}] int64")
    half = attn_inputs.check_rope(rope, hd)
    require(tuple(kv_norm.shape) == (hd,), "kv_norm.shape", tuple(kv_norm.shape), f"must be ({hd},)")
    require_dtype(kv_norm, "kv_norm", (torch.float32,))
    require(ring.dim() == 2 and ring.shape[1] == hd and ring.is_contiguous(), "ring.shape", tuple(ring.shape),
            f"must be a contiguous [S, {hd}]")
    require(ring.dtype == dt, "ring.dtype", ring.dtype, f"must be the activation dtype {dt}")
    require(not quant or hd % 32 == 0, "hd", hd, "must be a multiple of 32 (the FP8 blocks)")
    require_rows(kv, "kv")
    kv = kv.contiguous()
    di, w = 0, None
    if index_heads:
        n = products[1].weight.shape[0]
        require(n % index_heads == 0, "index_heads", index_heads, f"must divide the index queries' outputs {n}")
        di = n // index_heads
        require(2 * half <= di and di % 32 == 0, "index head width", di,
                "must hold the rope dims and be a multiple of 32 (the FP4 blocks)")
        require(iw is not None and tuple(iw.shape) == (t, index_heads) and iw.dtype == dt, "iw",
                None if iw is None else f"{tuple(iw.shape)} {iw.dtype}", f"must be [{t}, {index_heads}] {dt}")
        iw = iw.contiguous()
        w = torch.empty_like(iw)
    k = torch.empty((t, hd), dtype=dt, device=kv.device)
    rows = attn_inputs.QueryRows(kv, positions, rope, kv_norm, eps, ring, write, quant, k, di, iw, w, iw_scale)
    q, qi = _queries(linear.launch(x, products, norm, None, rows=rows), kv, index_heads)
    return q, k, qi, w
