"""A V4.1 KV source's compressor, row by row (one launch on the fast path): pooling, the compressed row and
its index key, and the writes to the state.

For a row at position p (ratio m; group j = p // m covers positions [j m, (j+1) m)):
- the group's slots q = j m .. j m + m - 1 come from this call's projections (q >= the call's first
  position) or from the compressor's ring (slot q mod size); latent = sum_s softmax_s(zeta_s) kappa_s per
  channel, rounded to the activation dtype, then RMSNorm (the compressor's norm);
- where p completes its group (p + 1 = (j + 1) m) the group's row j is written, else the trash row:
  the compressed row RoPE(latent) at position j m, FP4 fake-quantized with e4m3 scales per 16, and the
  index key RoPE(k_norm(wk latent)) at j m, FP4 fake-quantized with E8M0 scales per 32 (`quant` False: no
  fake quantization);
- with `write`, the row's projections [kappa | zeta] go to the ring (the last `size` rows of a call).
Without a gate (ratio 1) zeta is zero: the latent is kappa itself.

Reference: the model's torch ops before this fusion (appliance/model/compressor.py's pooling: softmax and
sum in float64, rounded once; the linear, rmsnorm, rope and formats references). Kernel: one program per
row, float32 throughout (softmax, the weighted sum in slot order, wk's product in column order, the norms);
nothing mixes rows: batch invariant. Tolerance: as kernels/attn_inputs.py (one rounding of the activation
dtype per output, one code step where a value sits at a fake-quantization boundary).
"""

import torch

from . import linear, rmsnorm
from . import rope as rope_op
from ._triton import (
    dependent_launch,
    device_function,
    device_of,
    e4m3_rne,
    pdl,
    pow2,
    require,
    require_dtype,
    round_out,
    tl,
    tmax,
    triton,
    tsum,
)
from .attn_inputs import check_rope, e2m1_rne, q4_e8m0_tile
from .formats import q4_e4m3, q4_e8m0


def reference(kappa: torch.Tensor, zeta: torch.Tensor | None, positions: torch.Tensor, ring: torch.Tensor,
              ratio: int, norm: torch.Tensor, eps: float, wk: linear.PackedWeight, k_norm: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor], kv_rows: torch.Tensor, key_rows: torch.Tensor, write: bool,
              quant: bool, dtype: torch.dtype) -> torch.Tensor:
    """kappa, zeta [T, w] float32 (zeta None: no gate), positions [T] (consecutive), ring [S, 2w] float32,
    rope (cos, sin) tables [P, r/2] of the compressed layers,
    kv_rows [R + 1, w] and key_rows [R + 1, dI] (row R: the trash row) written in place -> the row index
    each position wrote [T] (R where it completes no group)."""
    proj = torch.cat((kappa, torch.zeros_like(kappa) if zeta is None else zeta), dim=-1)
    w, size, trash = kappa.shape[1], ring.shape[0], kv_rows.shape[0] - 1
    start = positions[0]
    q = ((positions // ratio) * ratio).unsqueeze(1) + torch.arange(ratio, device=positions.device)  # [T, m]
    from_chunk = proj[(q - start).clamp(0, proj.shape[0] - 1)]
    slots = torch.where((q >= start).unsqueeze(-1), from_chunk, ring[torch.remainder(q, size)])
    weights = torch.softmax(slots[..., w:].double(), dim=1)
    latent = rmsnorm.reference((weights * slots[..., :w].double()).sum(1).float().to(dtype), norm, eps)
    if write:
        p, v = (positions, proj) if positions.numel() <= size else (positions[-size:], proj[-size:])
        ring[p % size] = v
    row = positions // ratio
    cos, sin = rope[0][row * ratio], rope[1][row * ratio]
    index = torch.where((positions + 1) % ratio == 0, row, torch.full_like(row, trash))
    keys = rope_op.reference(rmsnorm.reference(linear.reference(latent, wk, None, dtype), k_norm, eps), cos, sin)
    key_rows[index] = (q4_e8m0(keys, 32).to(keys.dtype) if quant else keys).to(key_rows.dtype)
    rows = rope_op.reference(latent, cos, sin)
    kv_rows[index] = (q4_e4m3(rows, 16).to(rows.dtype) if quant else rows).to(kv_rows.dtype)
    return index


# --- Triton kernel ---------------------------------------------------------------------------------------


@device_function
def _rope_vec(v, cols, n, pos, cos_ptr, sin_ptr, HALF: tl.constexpr, OUT_BF16: tl.constexpr):
    """RoPE of a float32 vector v [BC] (values at `cols`, n valid) on its last 2 HALF dims, rounded."""
    nope = n - 2 * HALF
    j = cols - nope
    rot = (j >= 0) & (cols < n)
    pair = pos * HALF + tl.where(rot, j // 2, 0)
    c = tl.load(cos_ptr + pair, mask=rot, other=1.0)
    s = tl.load(sin_ptr + pair, mask=rot, other=0.0)
    # the partner of each element: its pair's other half (the vector is in registers: swap by a reshape)
    pairs = tl.reshape(v, (v.shape[0] // 2, 2))
    a, b = tl.split(pairs)
    swapped = tl.reshape(tl.join(b, a), (v.shape[0],))
    even = (j % 2) == 0
    out = tl.where(even, v * c - swapped * s, swapped * s + v * c)
    return tl.where(rot, round_out(out, OUT_BF16).to(tl.float32), v)


@triton.jit(do_not_specialize=["T"])  # row counts vary call by call: one compile
def _kernel(kappa_ptr, zeta_ptr,  # float32 [T, w] projections of this call (zeta: GATE)
            pos_ptr,              # int64 [T]
            ring_ptr,             # float32 [S, 2w] the compressor's ring
            nw_ptr,               # float32 [w] the compressor's norm
            wk_ptr,               # bfloat16 / float32 [dI, w] the index key projection
            knw_ptr,              # float32 [dI] k_norm
            cos_ptr, sin_ptr,     # float32 [P, HALF] the compressed layers' RoPE tables
            lat_ptr,              # scratch [T, w] float32: the normed latents (read back in column chunks)
            kv_ptr,               # [R + 1, w] compressed rows
            key_ptr,              # [R + 1, dI] index keys
            idx_ptr,              # out int64 [T] the row each position wrote
            T, w, S, ratio, dI, trash, eps,
            GATE: tl.constexpr, WRITE: tl.constexpr, QUANT: tl.constexpr, OUT_BF16: tl.constexpr,
            HALF: tl.constexpr, BW: tl.constexpr, BM: tl.constexpr, BDI: tl.constexpr, BC: tl.constexpr,
            PDL: tl.constexpr):
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    start = tl.load(pos_ptr)
    cols = tl.arange(0, BW)
    cm = cols < w
    # the group's slots [BM, BW]: this call's rows from q = start on, the ring's before
    s = tl.arange(0, BM)
    q = (pos // ratio) * ratio + s
    qm = s < ratio
    chunk_row = tl.minimum(tl.maximum(q - start, 0), T - 1)
    in_chunk = q >= start
    m2 = qm[:, None] & cm[None, :]
    ring_row = ring_ptr + (q % S)[:, None] * (2 * w) + cols[None, :]
    kap = tl.where(in_chunk[:, None], tl.load(kappa_ptr + chunk_row[:, None] * w + cols[None, :], mask=m2, other=0.0),
                   tl.load(ring_row, mask=m2 & ~in_chunk[:, None], other=0.0))
    if GATE:
        zet = tl.where(in_chunk[:, None], tl.load(zeta_ptr + chunk_row[:, None] * w + cols[None, :], mask=m2,
                                                  other=0.0),
                       tl.load(ring_row + w, mask=m2 & ~in_chunk[:, None], other=0.0))
        zet = tl.where(qm[:, None], zet, float("-inf"))
        e = tl.exp(zet - tmax(zet, axis=0)[None, :])
        wts = e / tsum(e, axis=0)[None, :]
        lat = tsum(tl.where(qm[:, None], wts * kap, 0.0), axis=0)
    else:
        lat = tsum(tl.where(qm[:, None], kap, 0.0), axis=0)  # one slot, weight 1
    lat = round_out(lat, OUT_BF16).to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=cm, other=0.0)
    lat = round_out(nw * (lat * (1.0 / tl.sqrt_rn(tsum(lat * lat, axis=0) / w + eps))), OUT_BF16).to(tl.float32)
    if WRITE:
        if t >= T - S:
            slot = ring_ptr + (pos % S) * (2 * w)
            tl.store(slot + cols, tl.load(kappa_ptr + t * w + cols, mask=cm, other=0.0), mask=cm)
            if GATE:
                tl.store(slot + w + cols, tl.load(zeta_ptr + t * w + cols, mask=cm, other=0.0), mask=cm)
            else:
                tl.store(slot + w + cols, tl.zeros((BW,), dtype=tl.float32), mask=cm)
    row = pos // ratio
    index = tl.where((pos + 1) % ratio == 0, row, trash)
    tl.store(idx_ptr + t, index)
    rpos = row * ratio
    # the index key: wk . latent (float32, BC columns at a time in order), k_norm, RoPE, FP4
    tl.store(lat_ptr + t * w + cols, lat, mask=cm)
    tl.debug_barrier()  # the latent is read back by column chunks below
    ks = tl.arange(0, BDI)
    km = ks < dI
    acc = tl.zeros((BDI,), dtype=tl.float32)
    for c0 in range(0, w, BC):
        cc = c0 + tl.arange(0, BC)
        ccm = cc < w
        wt = tl.load(wk_ptr + ks[:, None] * w + cc[None, :], mask=km[:, None] & ccm[None, :], other=0.0).to(tl.float32)
        lc = tl.load(lat_ptr + t * w + cc, mask=ccm, other=0.0)
        acc += tsum(wt * lc[None, :], axis=1)
    key = round_out(acc, OUT_BF16).to(tl.float32)
    knw = tl.load(knw_ptr + ks, mask=km, other=0.0)
    key = round_out(knw * (key * (1.0 / tl.sqrt_rn(tsum(key * key, axis=0) / dI + eps))), OUT_BF16).to(tl.float32)
    key = _rope_vec(key, ks, dI, rpos, cos_ptr, sin_ptr, HALF, OUT_BF16)
    if QUANT:
        key = tl.reshape(q4_e8m0_tile(tl.reshape(key, (1, BDI)), 1, BDI), (BDI,))
    tl.store(key_ptr + index * dI + ks, round_out(key, OUT_BF16), mask=km)
    # the compressed row: RoPE, FP4 with e4m3 scales per 16
    r = _rope_vec(lat, cols, w, rpos, cos_ptr, sin_ptr, HALF, OUT_BF16)
    if QUANT:
        rb = tl.reshape(r, (BW // 16, 16))
        amax = tl.maximum(tmax(tl.abs(rb), axis=1), 6.0 * 2.0**-9)
        sc = e4m3_rne(tl.minimum(tl.math.div_rn(amax, 6.0), 448.0))[:, None]
        r = tl.reshape(e2m1_rne(tl.minimum(tl.maximum(tl.math.div_rn(rb, sc), -6.0), 6.0)) * sc, (BW,))
    tl.store(kv_ptr + index * w + cols, round_out(r, OUT_BF16), mask=cm)


def fast(kappa: torch.Tensor, zeta: torch.Tensor | None, positions: torch.Tensor, ring: torch.Tensor,
         ratio: int, norm: torch.Tensor, eps: float, wk: linear.PackedWeight, k_norm: torch.Tensor,
         rope: tuple[torch.Tensor, torch.Tensor], kv_rows: torch.Tensor, key_rows: torch.Tensor, write: bool,
         quant: bool, dtype: torch.dtype) -> torch.Tensor:
    """The kernel for `reference` (same signature; results within the stated tolerance)."""
    require_dtype(kappa, "kappa", (torch.float32,))
    require(kappa.dim() == 2 and kappa.is_contiguous(), "kappa.shape", tuple(kappa.shape),
            "must be a contiguous [T, w]")
    t, w = kappa.shape
    if zeta is not None:
        require(zeta.shape == kappa.shape and zeta.dtype == torch.float32, "zeta", tuple(zeta.shape),
                f"must be [{t}, {w}] float32")
        zeta = zeta.contiguous()
    require(ratio >= 1, "ratio", ratio, "must be >= 1")
    require(ring.dim() == 2 and ring.shape[1] == 2 * w and ring.dtype == torch.float32 and ring.is_contiguous(),
            "ring", f"{tuple(ring.shape)} {ring.dtype}", f"must be a contiguous [S, {2 * w}] float32")
    require(ring.shape[0] >= ratio, "ring.shape[0]", ring.shape[0], f"must hold a group ({ratio})")
    require(wk.format == "dense" and wk.shape[1] == w, "wk", f"{wk.format} {wk.shape}", f"must be dense [dI, {w}]")
    di = wk.shape[0]
    half = check_rope(rope, min(w, di))
    require(not quant or (w % 16 == 0 and di % 32 == 0), "w, dI", (w, di), "must be multiples of 16 and 32")
    for name, rows, width in (("kv_rows", kv_rows, w), ("key_rows", key_rows, di)):
        require(rows.dim() == 2 and rows.shape[1] == width and rows.is_contiguous() and rows.dtype == dtype, name,
                f"{tuple(rows.shape)} {rows.dtype}", f"must be a contiguous [R + 1, {width}] {dtype}")
    require(kv_rows.shape[0] == key_rows.shape[0], "key_rows.shape[0]", key_rows.shape[0],
            f"must equal kv_rows.shape[0] {kv_rows.shape[0]}")
    dev = device_of(kappa, positions, ring, norm, wk.data, k_norm, *rope, kv_rows, key_rows)
    index = torch.empty(t, dtype=torch.int64, device=dev)
    if t:
        lat = torch.empty((t, w), dtype=torch.float32, device=dev)
        _kernel[(t,)](kappa, kappa if zeta is None else zeta, positions, ring, norm, wk.data, k_norm, *rope, lat,
                      kv_rows, key_rows, index, t, w, ring.shape[0], ratio, di, kv_rows.shape[0] - 1, float(eps),
                      GATE=zeta is not None, WRITE=write, QUANT=quant, OUT_BF16=dtype == torch.bfloat16, HALF=half,
                      BW=pow2(w, 16), BM=pow2(ratio), BDI=pow2(di, 32), BC=min(pow2(w, 16), 64), **pdl(kappa.device))
    return index
