"""What a V4.1 attention does to its projections, row by row, before it attends (one launch on the fast path):

- queries: RoPE on the last r dims of each head, by the row's position;
- the window key: RMSNorm (kv_norm), RoPE, the official FP8 fake quantization (power-of-two scales per 32,
  all dims), written to the window ring at slot position mod size (the last `size` rows of a call only)
  when `write` (a caller that attends to ring slots this call would overwrite writes after attending);
- the indexer's queries (index-source layers): RoPE, FP4 fake quantization (E8M0 scales per 32), and its
  head weights scaled: (w * dI^-1/2 nh^-1/2) in the activation dtype.
RoPE's cos and sin come from tables by position (`rope` = (cos, sin) [P, r/2] float32, rope.table's values:
fl32(position * f_i), as the official code precomputes them; no transcendental function in a kernel);
`quant` False skips the fake quantizations (plain numerics). Reference: the torch ops the model ran before
this fusion, in the same order (rope, rmsnorm and formats references).

`QueryRows`, `rope_tile`, `key_row`: the same work inside the launch of the query products, beside the
tiles they store (kernels/query_inputs.py; no launch of its own in a decode step).

`window_keys`: several attentions' window keys of the same rows (DSpark's stages), each into its ring; its
kernel (`fast_window_keys`) one launch of programs (row, attention), each the window-key part of `fast`.

Kernel (`fast`): programs (row, part): part 0 the window key and head weights, parts 1.. blocks of query heads
(rotated in place: the nope dims of a query are not touched, so the query buffer is the projection's) and of
index heads. float32 throughout; everything is per row: batch invariant. Tolerance against the reference
(relative to a row's largest |value|): one rounding of the activation dtype per RoPE and RMSNorm output
(bfloat16: 2^-8), the float32 RMSNorm sum, and where a value sits at a rounding boundary of the fake
quantization, one code step of that element (e4m3: 2^-3 of it; e2m1: up to half its block's scale).
"""

from dataclasses import dataclass

import torch

from . import rmsnorm
from . import rope as rope_op
from ._triton import (
    INTERPRET,
    dependent_launch,
    device_function,
    device_of,
    pdl,
    pow2,
    pow2_ceil,
    require,
    require_dtype,
    require_rows,
    round_out,
    tl,
    tmax,
    triton,
    tsum,
)
from .formats import q4_e8m0, q8_pow2
from .rows import quant_tile


def reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              kv_norm: torch.Tensor, eps: float, ring: torch.Tensor, write: bool, quant: bool,
              qi: torch.Tensor | None = None, iw: torch.Tensor | None = None, iw_scale: float = 1.0):
    """q [T, H, hd] (the query projection), kv [T, hd] (the window key projection), positions [T] int64,
    rope (cos, sin) tables [P, r/2] float32, kv_norm [hd]; ring [S, hd] (written in place when `write`); qi
    [T, nh, dI] and iw [T, nh] (index-source layers) -> (q, k [T, hd], qi, iw) in the activation dtype (qi,
    iw None when not given)."""
    cos, sin = rope[0][positions], rope[1][positions]
    q = rope_op.reference(q, cos.unsqueeze(1), sin.unsqueeze(1))
    k = rope_op.reference(rmsnorm.reference(kv, kv_norm, eps), cos, sin)
    if quant:
        k = q8_pow2(k, 32).to(k.dtype)
    if write:
        size = ring.shape[0]
        p, v = (positions, k) if positions.numel() <= size else (positions[-size:], k[-size:])
        ring[p % size] = v.to(ring.dtype)
    if qi is not None:
        qi = rope_op.reference(qi, cos.unsqueeze(1), sin.unsqueeze(1))
        if quant:
            qi = q4_e8m0(qi, 32).to(qi.dtype)
        iw = (iw.float() * torch.tensor(iw_scale, dtype=torch.float32)).to(iw.dtype)
    return q, k, qi, iw


def window_keys(kvs: list[torch.Tensor], positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_norms: list[torch.Tensor], eps: float, rings: list[torch.Tensor], quant: bool) -> None:
    """Several attentions' window keys at the same positions, each into its own ring (DSpark's stages: every
    stage's key of the same rows): `reference` with no query heads, one attention after another (kvs[i] [T,
    hd], kv_norms[i] [hd], rings[i] [S, hd] written in place)."""
    for kv, norm, ring in zip(kvs, kv_norms, rings, strict=True):
        reference(kv.new_empty((kv.shape[0], 0, kv.shape[1])), kv, positions, rope, norm, eps, ring, True, quant)


@dataclass(frozen=True)
class QueryRows:
    """`fast`'s work without a launch of its own (kernels/query_inputs.py): given to the launch of the query
    products (kernels/linear.py `launch`), whose programs rotate the queries (product 0, heads kv's width)
    and the index queries (product 1 where `index_width`: RoPE and FP4) tile by tile once they stored them,
    and whose one more program a row writes its window key (and index head weights). `fast`'s
    arguments, checked by the caller, with its outputs k (and w) allocated."""
    kv: torch.Tensor  # [T, hd] the window key projection, contiguous
    positions: torch.Tensor  # int64 [T]
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [P, r/2] float32
    kv_norm: torch.Tensor  # float32 [hd]
    eps: float
    ring: torch.Tensor  # [S, hd] written in place (write)
    write: bool
    quant: bool
    k: torch.Tensor  # out [T, hd]
    index_width: int = 0  # dI: the index queries' head width (0: none)
    iw: torch.Tensor | None = None  # [T, nh] index head weights (index_width)
    w: torch.Tensor | None = None  # out [T, nh] (index_width)
    iw_scale: float = 1.0


def row_work_args(rows: QueryRows | None, filler: torch.Tensor, end: int) -> tuple[tuple, list, dict]:
    """kernels/linear.py `_kernel`'s ROWS arguments (tensors, runtime values, constexprs) for `rows` (None:
    off, `filler` in every tensor's place); the row work's programs are those after the products' `end`, one
    a row of the block."""
    if rows is None:
        return (filler,) * 9, [1, 1, 1, 1, 0.0, 1.0, -1], dict(ROWS=False, R_HALF=1, R_WRITE=False, R_QUANT=False,
                                                              R_INDEX=False, R_BF16=False, R_BHD=1, R_BNH=1)
    hd, nh = rows.kv.shape[1], rows.w.shape[1] if rows.index_width else 1
    tensors = (rows.positions, *rows.rope, rows.kv, rows.kv_norm, rows.ring, rows.k,
               rows.iw if rows.index_width else filler, rows.w if rows.index_width else filler)
    return tensors, [hd, max(rows.index_width, 1), rows.ring.shape[0], nh, float(rows.eps), float(rows.iw_scale),
                     end], dict(ROWS=True, R_HALF=rows.rope[0].shape[1], R_WRITE=rows.write, R_QUANT=rows.quant,
                                R_INDEX=bool(rows.index_width), R_BF16=rows.k.dtype == torch.bfloat16,
                                R_BHD=pow2(hd), R_BNH=pow2(nh))


# --- Triton kernel ---------------------------------------------------------------------------------------


@device_function
def _rotate(x_ptr, row, n_heads, hd, heads, cols, pos, cos_ptr, sin_ptr, HALF: tl.constexpr, OUT_BF16: tl.constexpr):
    """Load heads `heads` of row `row` of x [T, n_heads, hd] with RoPE applied to their last 2 HALF dims
    (interleaved pairs), as float32 [BH, BC] over columns `cols` of a head (values rounded to x's dtype)."""
    hmask = heads < n_heads
    m = hmask[:, None] & (cols[None, :] < hd)
    base = x_ptr + (row * n_heads + heads[:, None].to(tl.int64)) * hd
    v = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    nope = hd - 2 * HALF
    j = cols - nope  # position inside the rotated part
    rot = (j >= 0) & (cols < hd)
    pair = pos * HALF + tl.where(rot, j // 2, 0)
    c = tl.load(cos_ptr + pair, mask=rot, other=1.0)
    s = tl.load(sin_ptr + pair, mask=rot, other=0.0)
    partner = tl.load(base + tl.where(rot, cols ^ 1, cols)[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)
    return _turn(v, partner, c[None, :], s[None, :], ((j % 2) == 0)[None, :], rot[None, :], OUT_BF16)


@device_function
def _turn(v, partner, c, s, even, rot, OUT_BF16: tl.constexpr):
    """RoPE of interleaved pairs, elementwise (broadcasting): (a, b) -> (a c - b s, a s + b c), where an
    even column is a and its partner b, an odd one b and its partner a; rounded to the output dtype where
    `rot`, v elsewhere (float32)."""
    out = tl.where(even, v * c - partner * s, partner * s + v * c)
    return tl.where(rot, round_out(out, OUT_BF16).to(tl.float32), v)


def check_rope(rope: tuple[torch.Tensor, torch.Tensor], width: int) -> int:
    """The half width of RoPE tables (cos, sin) [P, r/2] float32 for rows `width` wide, checked."""
    cos_t, sin_t = rope
    require(cos_t.dim() == 2 and cos_t.shape == sin_t.shape and cos_t.dtype == sin_t.dtype == torch.float32,
            "rope", f"{tuple(cos_t.shape)} {cos_t.dtype} / {tuple(sin_t.shape)} {sin_t.dtype}",
            "must be two float32 tables [P, r/2]")
    require(cos_t.is_contiguous() and sin_t.is_contiguous(), "rope", "strided", "the tables must be contiguous")
    half = cos_t.shape[1]
    require(2 * half <= width and half & (half - 1) == 0, "rope.shape[1]", half,
            f"must be a power of two <= {width // 2}")
    return half


@device_function
def e2m1_rne(x):
    """formats.round_e2m1: the nearest e2m1 value (ties to the even code), clamped to [-6, 6], the sign of
    x kept (as copysign keeps it, -0 included)."""
    mag = tl.minimum(tl.abs(x), 6.0)
    v = tl.where(mag > 0.25, 0.5, 0.0)
    v = tl.where(mag >= 0.75, 1.0, v)
    v = tl.where(mag > 1.25, 1.5, v)
    v = tl.where(mag >= 1.75, 2.0, v)
    v = tl.where(mag > 2.5, 3.0, v)
    v = tl.where(mag >= 3.5, 4.0, v)
    v = tl.where(mag > 5.0, 6.0, v)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@device_function
def q4_e8m0_tile(x, BR: tl.constexpr, BC: tl.constexpr):
    """formats.q4_e8m0(x, 32) of a float32 [BR, BC] tile (BC a multiple of 32)."""
    xb = tl.reshape(x, (BR, BC // 32, 32))
    amax = tl.maximum(tmax(tl.abs(xb), axis=2), 6.0 * 2.0**-126)
    s = pow2_ceil(amax * (1.0 / 6.0))[:, :, None]
    return tl.reshape(e2m1_rne(xb / s) * s, (BR, BC))


@device_function
def rope_tile(y_ptr, rows, row_mask, cols, N, hd, pos_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, QUANT4: tl.constexpr,
              OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """`fast`'s query work on a tile a weight product stored: rows `rows` and columns `cols` [BN] of y [M, N]
    (heads hd wide, in the product's dtype) rotated in place by the rows' positions (the arithmetic of
    `_rotate`), and (QUANT4, the index queries) fake-quantized to FP4 per 32 columns. The tile is [BN, BM]
    (the product's orientation); every column block of 32 lies in one tile (BN a multiple of 32)."""
    tl.debug_barrier()  # the tile's stores, by every thread of this program, are read back below
    mask = (cols < N)[:, None] & row_mask[None, :]
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    base = y_ptr + rows.to(tl.int64)[None, :] * N
    v = tl.load(base + cols[:, None], mask=mask, other=0.0).to(tl.float32)  # [BN, BM]
    j = cols % hd - (hd - 2 * HALF)  # position inside a head's rotated part
    rot = (j >= 0) & (cols < N)
    pair = pos[None, :] * HALF + tl.where(rot, j // 2, 0)[:, None]
    rm = rot[:, None] & row_mask[None, :]
    c = tl.load(cos_ptr + pair, mask=rm, other=1.0)
    s = tl.load(sin_ptr + pair, mask=rm, other=0.0)
    partner = tl.load(base + tl.where(rot, cols ^ 1, cols)[:, None], mask=rm, other=0.0).to(tl.float32)
    out = _turn(v, partner, c, s, ((j % 2) == 0)[:, None], rot[:, None], OUT_BF16)
    if QUANT4:
        out = tl.trans(q4_e8m0_tile(tl.trans(out), BM, BN))
    tl.debug_barrier()  # every partner was read before any element is overwritten
    tl.store(base + cols[:, None], round_out(out, OUT_BF16), mask=mask)


@device_function
def key_row(kv_ptr, nw_ptr, ring_ptr, k_ptr, iw_ptr, wo_ptr, pos_ptr, cos_ptr, sin_ptr, t, T, hd, S, nh, eps,
            iw_scale, WRITE: tl.constexpr, QUANT: tl.constexpr, INDEX: tl.constexpr, OUT_BF16: tl.constexpr,
            HALF: tl.constexpr, BHD: tl.constexpr, BNH: tl.constexpr):
    """`fast`'s part 0 for row t (int64; nothing where t >= T): its window key (and ring write) and, INDEX,
    its index head weights scaled."""
    if t < T:
        pos = tl.load(pos_ptr + t)
        _window_key(kv_ptr, nw_ptr, ring_ptr, k_ptr, t, T, pos, hd, S, eps, cos_ptr, sin_ptr, WRITE, QUANT,
                    OUT_BF16, HALF, BHD)
        if INDEX:
            heads = tl.arange(0, BNH)
            hm = heads < nh
            iw = tl.load(iw_ptr + t * nh + heads, mask=hm, other=0.0).to(tl.float32)
            tl.store(wo_ptr + t * nh + heads, round_out(iw * iw_scale, OUT_BF16), mask=hm)


@device_function
def _window_key(kv_ptr, nw_ptr, ring_ptr, k_ptr, t, T, pos, hd, S, eps, cos_ptr, sin_ptr, WRITE: tl.constexpr,
                QUANT: tl.constexpr, OUT_BF16: tl.constexpr, HALF: tl.constexpr, BHD: tl.constexpr):
    """Row t's window key into k [T, hd] (and the ring, WRITE): RMSNorm of kv's row, RoPE at `pos`, the FP8
    fake quantization (QUANT)."""
    cols = tl.arange(0, BHD)
    cm = cols < hd
    x = tl.load(kv_ptr + t * hd + cols, mask=cm, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tsum(x * x, axis=0) / hd + eps)
    w = tl.load(nw_ptr + cols, mask=cm, other=0.0)
    tl.store(k_ptr + t * hd + cols, round_out(w * (x * r), OUT_BF16), mask=cm)
    tl.debug_barrier()  # the normed key is re-read below by the rotation's partner loads
    k = _rotate(k_ptr, t, 1, hd, tl.arange(0, 1), cols, pos, cos_ptr, sin_ptr, HALF, OUT_BF16)  # [1, BHD]
    tl.debug_barrier()
    if QUANT:
        k = quant_tile(k, 1, BHD, 32)
    k = round_out(k, OUT_BF16)
    tl.store(k_ptr + t * hd + cols[None, :], k, mask=cm[None, :])
    if WRITE:
        if t >= T - S:  # only the last S rows of a call survive in the ring
            tl.store(ring_ptr + (pos % S) * hd + cols[None, :], k, mask=cm[None, :])


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _kernel(q_ptr,      # [T, H, hd] queries, rotated in place
            kv_ptr,     # [T, hd] window key projection
            pos_ptr,    # int64 [T]
            cos_ptr, sin_ptr,  # float32 [P, HALF] RoPE tables
            nw_ptr,     # float32 [hd] kv_norm weight
            ring_ptr,   # [S, hd] window ring (WRITE)
            k_ptr,      # out [T, hd] window keys
            qi_ptr,     # [T, nh, dI] index queries (INDEX), read
            qo_ptr,     # out [T, nh, dI] index queries (INDEX)
            iw_ptr,     # [T, nh] index head weights, read (INDEX)
            wo_ptr,     # out [T, nh] (INDEX)
            T, H, hd, S, nh, dI, eps, iw_scale, q_blocks,
            WRITE: tl.constexpr, QUANT: tl.constexpr, INDEX: tl.constexpr, OUT_BF16: tl.constexpr,
            HALF: tl.constexpr, BHD: tl.constexpr, BQH: tl.constexpr, BIH: tl.constexpr, BDI: tl.constexpr,
            BNH: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    if part == 0:  # the window key (and the index head weights)
        key_row(kv_ptr, nw_ptr, ring_ptr, k_ptr, iw_ptr, wo_ptr, pos_ptr, cos_ptr, sin_ptr, t, T, hd, S, nh, eps,
                iw_scale, WRITE, QUANT, INDEX, OUT_BF16, HALF, BHD, BNH)
    elif part <= q_blocks:  # a block of query heads: rotate the rope dims in place
        qheads = (part - 1) * BQH + tl.arange(0, BQH)
        rcols = hd - 2 * HALF + tl.arange(0, 2 * HALF)
        qv = _rotate(q_ptr, t, H, hd, qheads, rcols, pos, cos_ptr, sin_ptr, HALF, OUT_BF16)
        tl.debug_barrier()  # every partner was read before any element is overwritten
        tl.store(q_ptr + (t * H + qheads[:, None].to(tl.int64)) * hd + rcols[None, :], round_out(qv, OUT_BF16),
                 mask=(qheads[:, None] < H))
    else:  # a block of index heads: rotate, quantize
        iheads = (part - 1 - q_blocks) * BIH + tl.arange(0, BIH)
        icols = tl.arange(0, BDI)
        iv = _rotate(qi_ptr, t, nh, dI, iheads, icols, pos, cos_ptr, sin_ptr, HALF, OUT_BF16)
        if QUANT:
            iv = q4_e8m0_tile(iv, BIH, BDI)
        tl.store(qo_ptr + (t * nh + iheads[:, None].to(tl.int64)) * dI + icols[None, :], round_out(iv, OUT_BF16),
                 mask=(iheads[:, None] < nh) & (icols[None, :] < dI))


def fast(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
         kv_norm: torch.Tensor, eps: float, ring: torch.Tensor, write: bool, quant: bool,
         qi: torch.Tensor | None = None, iw: torch.Tensor | None = None, iw_scale: float = 1.0):
    """The kernel for `reference` (same signature; results within the stated tolerance). The queries are
    rotated in place (the returned q is `q`)."""
    require_dtype(q, "q", (torch.float32, torch.bfloat16))
    require(q.dim() == 3 and q.is_contiguous(), "q.shape", tuple(q.shape), "must be a contiguous [T, H, hd]")
    t, h, hd = q.shape
    require(tuple(kv.shape) == (t, hd) and kv.dtype == q.dtype, "kv", f"{tuple(kv.shape)} {kv.dtype}",
            f"must be [{t}, {hd}] {q.dtype}")
    require(tuple(positions.shape) == (t,) and positions.dtype == torch.int64, "positions",
            f"{tuple(positions.shape)} {positions.dtype}", f"must be [{t}] int64")
    cos_t, sin_t = rope
    half = check_rope(rope, hd)
    require(tuple(kv_norm.shape) == (hd,), "kv_norm.shape", tuple(kv_norm.shape), f"must be ({hd},)")
    require_dtype(kv_norm, "kv_norm", (torch.float32,))
    require(ring.dim() == 2 and ring.shape[1] == hd, "ring.shape", tuple(ring.shape), f"must be [S, {hd}]")
    require(ring.dtype == q.dtype, "ring.dtype", ring.dtype, f"must be the activation dtype {q.dtype}")
    require(not quant or hd % 32 == 0, "hd", hd, "must be a multiple of 32 (the FP8 blocks)")
    index = qi is not None
    if index:
        require(qi.dim() == 3 and qi.shape[0] == t and qi.dtype == q.dtype, "qi.shape", tuple(qi.shape),
                f"must be [{t}, nh, dI] {q.dtype}")
        nh, di = qi.shape[1:]
        require(2 * half <= di and (not quant or di % 32 == 0), "qi.shape[2]", di,
                "must hold the rope dims and be a multiple of 32")
        require(tuple(iw.shape) == (t, nh), "iw.shape", tuple(iw.shape), f"must be {(t, nh)}")
        require_rows(qi, "qi")
        qi, iw = qi.contiguous(), iw.contiguous()
    else:
        nh, di = 1, 32
    dev = device_of(q, kv, positions, cos_t, sin_t, kv_norm, ring)
    require_rows(kv, "kv")
    require(ring.is_contiguous(), "ring.stride", ring.stride(), "must be contiguous")
    kv = kv.contiguous()
    k = torch.empty((t, hd), dtype=q.dtype, device=dev)
    qo = torch.empty_like(qi) if index else None
    wo = torch.empty_like(iw) if index else None
    if t == 0:
        return q, k, qo, wo
    bqh = max(1, min(pow2(h), (8192 if INTERPRET else 512) // (2 * half)))
    bih = max(1, min(pow2(nh), (8192 if INTERPRET else 512) // pow2(di)))
    q_blocks = triton.cdiv(h, bqh)
    parts = 1 + q_blocks + (triton.cdiv(nh, bih) if index else 0)
    _kernel[(t, parts)](q, kv, positions, cos_t, sin_t, kv_norm, ring, k, qi if index else k, qo if index else k,
                        iw if index else k, wo if index else k, t, h, hd, ring.shape[0], nh, di, float(eps),
                        float(iw_scale), q_blocks, WRITE=write, QUANT=quant, INDEX=index,
                        OUT_BF16=q.dtype == torch.bfloat16, HALF=half, BHD=pow2(hd), BQH=bqh, BIH=bih,
                        BDI=pow2(di), BNH=pow2(nh), **pdl(q.device))
    return q, k, qo, wo


@triton.jit(do_not_specialize=["T"])
def _keys_kernel(kvs,       # ATTNS [T, hd] window key projections (a tuple)
                 pos_ptr,   # int64 [T]
                 cos_ptr, sin_ptr,  # float32 [P, HALF] RoPE tables
                 nws,       # ATTNS float32 [hd] kv_norm weights (a tuple)
                 rings,     # ATTNS [S, hd] window rings (a tuple)
                 k_ptr,     # scratch [ATTNS, T, hd]: the keys before their ring write
                 T, hd, S, eps,
                 ATTNS: tl.constexpr, QUANT: tl.constexpr, OUT_BF16: tl.constexpr, HALF: tl.constexpr,
                 BHD: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    a = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    for i in tl.static_range(ATTNS):  # a tuple's entries are chosen at compile time
        if a == i:
            _window_key(kvs[i], nws[i], rings[i], k_ptr + i * T * hd, t, T, pos, hd, S, eps, cos_ptr, sin_ptr, True,
                        QUANT, OUT_BF16, HALF, BHD)


def fast_window_keys(kvs: list[torch.Tensor], positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     kv_norms: list[torch.Tensor], eps: float, rings: list[torch.Tensor], quant: bool) -> None:
    """The kernel for `window_keys` (same signature; each ring the same bits as `fast` writes it): one launch,
    programs (row, attention)."""
    n = len(kvs)
    require(1 <= n == len(kv_norms) == len(rings), "kvs", n, "must be one or more, one per kv_norm and ring")
    t, hd = kvs[0].shape
    size = rings[0].shape[0]
    require(tuple(positions.shape) == (t,) and positions.dtype == torch.int64, "positions",
            f"{tuple(positions.shape)} {positions.dtype}", f"must be [{t}] int64")
    half = check_rope(rope, hd)
    for i, (kv, norm, ring) in enumerate(zip(kvs, kv_norms, rings)):
        require(tuple(kv.shape) == (t, hd) and kv.dtype in (torch.float32, torch.bfloat16), f"kvs[{i}]",
                f"{tuple(kv.shape)} {kv.dtype}", f"must be [{t}, {hd}] float32 or bfloat16")
        require(kv.dtype == kvs[0].dtype, f"kvs[{i}].dtype", kv.dtype, f"must be kvs[0]'s {kvs[0].dtype}")
        require(tuple(norm.shape) == (hd,), f"kv_norms[{i}].shape", tuple(norm.shape), f"must be ({hd},)")
        require_dtype(norm, f"kv_norms[{i}]", (torch.float32,))
        require(tuple(ring.shape) == (size, hd) and ring.dtype == kv.dtype and ring.is_contiguous(), f"rings[{i}]",
                f"{tuple(ring.shape)} {ring.dtype}", f"must be a contiguous [{size}, {hd}] {kv.dtype}")
    require(not quant or hd % 32 == 0, "hd", hd, "must be a multiple of 32 (the FP8 blocks)")
    dev = device_of(*kvs, positions, *rope, *kv_norms, *rings)
    if t == 0:
        return
    kvs = tuple(kv.contiguous() for kv in kvs)
    k = torch.empty((n, t, hd), dtype=kvs[0].dtype, device=dev)
    _keys_kernel[(t, n)](kvs, positions, *rope, tuple(kv_norms), tuple(rings), k, t, hd, size, float(eps), ATTNS=n,
                         QUANT=quant, OUT_BF16=kvs[0].dtype == torch.bfloat16, HALF=half, BHD=pow2(hd),
                         **pdl(dev))
