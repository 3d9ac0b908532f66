"""Number formats of the DeepSeek-V4 checkpoints, decoded and rounded exactly in torch.

Weights: FP8 e4m3 (`float8_e4m3fn`) with E8M0 block scales (`float8_e8m0fnu`, value 2^(e-127)), and FP4
e2m1 packed two per int8 byte (element 2c in the low nibble, 2c+1 in the high nibble) with one E8M0 scale
per 32 inputs. Activations and KV rows are "fake quantized" by the official code: rounded to the codes
a real FP8/FP4 kernel would see, then kept as floats. Every function here is exact: the dequantized
values fit float32 (and bfloat16) without rounding.
"""

import torch

# e2m1 code -> value; codes 8..15 are the negatives (8 is -0).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# Round-to-nearest-even on e2m1 magnitudes: the midpoints between neighbouring codes, and whether an
# exact tie goes up (the upper neighbour has the even code) or stays down.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])
_E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu or raw uint8 exponents) -> float32 powers of two."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.float()
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones((), dtype=torch.float32), scale.to(torch.int32) - 127)
    raise TypeError(f"E8M0 scale: dtype {scale.dtype} is not float8_e8m0fnu or uint8")


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [rows, K/2] -> float32 e2m1 values [rows, K] (low nibble = even column)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"FP4 weight: dtype {packed.dtype} is not int8")
    byte = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)
    return E2M1_VALUES.to(packed.device)[codes]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes int [rows, K] (0..15) -> int8 [rows, K/2], low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 pack: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 e4m3 [out, in] with E8M0 [ceil(out/bo), ceil(in/bi)] block scales -> float32 [out, in]."""
    out_f, in_f = weight.shape
    bo, bi = block
    want = (-(-out_f // bo), -(-in_f // bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} != {want} for weight {tuple(weight.shape)}")
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return weight.float() * s


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 int8 [out, in/2] with E8M0 [out, in/block] scales -> float32 [out, in]."""
    values = unpack_fp4(packed)
    out_f, in_f = values.shape
    if tuple(scale.shape) != (out_f, in_f // block):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} != {(out_f, in_f // block)}")
    return values * e8m0_to_float(scale).repeat_interleave(block, 1)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive normal float32 v, from the bit pattern (a float log2 misrounds at
    exact powers of two): adding 2^23 - 1 to the bits carries into the exponent exactly when the mantissa
    is non-zero, then the mantissa is cleared."""
    bits = v.float().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest e2m1 value (ties to the even code), clamping to [-6, 6]."""
    mag = x.abs().clamp(max=6.0)
    mid = _E2M1_MIDPOINTS.to(x.device)
    idx = torch.bucketize(mag, mid, right=False)  # number of midpoints strictly below mag
    at_mid = idx < len(mid)
    tie_up = _E2M1_TIE_GOES_UP.to(x.device)[idx.clamp(max=len(mid) - 1)]
    idx = idx + (at_mid & tie_up & (mag == mid[idx.clamp(max=len(mid) - 1)])).to(idx.dtype)
    return torch.copysign(_E2M1_MAGNITUDES.to(x.device)[idx], x)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"quantization block {block} does not divide last dim {x.shape[-1]}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


_INV_448 = 1.0 / 448.0  # python floats: the multiply happens in float32 (fl32(a * fl32(1/448)))
_INV_6 = 1.0 / 6.0


def q8_pow2(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 activation quantization with power-of-two scales per `block` elements, dequantized.

    Official rule: a = max(amax, 1e-4); s = 2^ceil(log2(fl32(a * fl32(1/448)))); q = e4m3(x / s)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_(min=1e-4)
    s = pow2_ceil(amax.mul_(_INV_448))
    q = (xb / s).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return q.mul_(s).flatten(-2)


def q4_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 fake quantization with power-of-two (E8M0) scales per `block`, dequantized (index q/k)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0**-126)
    s = pow2_ceil(amax * _INV_6)
    return (round_e2m1(xb / s) * s).flatten(-2)


def q4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 fake quantization with e4m3 scales per `block`, dequantized (V4.1 compressed KV rows)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0**-9)
    s = (amax / 6.0).to(torch.float8_e4m3fn).float()
    return (round_e2m1((xb / s).clamp(-6.0, 6.0)) * s).flatten(-2)


# --- encoders: floats -> the stored formats (tiny checkpoints, benchmarks, tests) -----------------------


def e8m0_from_pow2(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two -> float8_e8m0fnu, from the exponent bits (exact; no log2 rounding)."""
    return ((scale.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """e2m1 values (as `round_e2m1` gives them) -> codes 0..15. A zero of either sign is code 0: the one
    rule for -0 (what matters is the value, and +0 keeps a packed zero row all zero bytes)."""
    mags = _E2M1_MAGNITUDES.to(values.device)
    idx = torch.bucketize(values.abs(), mags)
    return idx + 8 * ((values < 0) & (idx > 0)).to(idx.dtype)


def encode_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (e4m3 [out, in], E8M0 [ceil(out/bo), ceil(in/bi)]): one power-of-two scale per
    block, the smallest that keeps the block's largest magnitude within e4m3's 448."""
    out_f, in_f = w.shape
    bo, bi = block
    ro, ri = -(-out_f // bo), -(-in_f // bi)
    pad = torch.zeros(ro * bo, ri * bi, device=w.device)
    pad[:out_f, :in_f] = w
    blocks = pad.view(ro, bo, ri, bi)
    scale = pow2_ceil(blocks.abs().amax((1, 3)).clamp(min=1e-8) / 448.0)
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(ro * bo, ri * bi)[:out_f, :in_f].contiguous(), e8m0_from_pow2(scale)


def encode_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (e2m1 packed int8 [out, in/2], E8M0 [out, in/32]): one power-of-two scale per 32
    inputs, the smallest that keeps their largest magnitude within e2m1's 6, values rounded to nearest even."""
    out_f, in_f = w.shape
    wb = w.float().view(out_f, in_f // 32, 32)
    scale = pow2_ceil(wb.abs().amax(-1).clamp(min=1e-8) / 6.0)
    values = round_e2m1(wb / scale.unsqueeze(-1)).view(out_f, in_f)
    return pack_fp4(e2m1_codes(values)), e8m0_from_pow2(scale)
