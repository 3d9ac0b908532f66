"""Number formats: FP8 / FP4 dequantization against hand-computed values, and the activation quantizers."""

import torch

from kernels.formats import (
    dequant_fp4,
    dequant_fp8,
    e2m1_codes,
    e8m0_from_pow2,
    e8m0_to_float,
    encode_fp4,
    encode_fp8,
    pack_fp4,
    pow2_ceil,
    q4_e4m3,
    q4_e8m0,
    q8_pow2,
    round_e2m1,
    unpack_fp4,
)


def e8m0(exponents):
    return torch.tensor(exponents, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_scales_are_powers_of_two_including_the_smallest():
    s = e8m0([[0, 1, 126, 127, 128, 254]])
    assert e8m0_to_float(s).tolist() == [[2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]]


def test_fp8_dequantization_matches_hand_computed_values_on_an_odd_shape():
    # 3 x 5 weight, block (2, 4): scale rows = ceil(3/2) = 2, cols = ceil(5/4) = 2
    values = torch.tensor([[1.0, -2.0, 0.5, -448.0, 3.5],
                           [0.001953125, -0.0, 6.0, -0.375, 1.25],
                           [-1.0, 2.0, -3.0, 4.0, -5.0]])
    w = values.to(torch.float8_e4m3fn)
    assert torch.equal(w.float(), values)  # all exactly representable, incl. the smallest subnormal 2^-9
    scale = e8m0([[127 - 3, 127 + 2], [1, 127]])  # 2^-3, 2^2, 2^-126, 1
    got = dequant_fp8(w, scale, (2, 4))
    want = values.clone()
    want[:2, :4] *= 2.0**-3
    want[:2, 4:] *= 4.0
    want[2:, :4] *= 2.0**-126
    assert torch.equal(got, want)


def test_fp4_nibbles_low_first_with_negative_codes_and_minus_zero():
    # element 2c in the low nibble, 2c+1 in the high nibble; codes 8..15 negative (8 = -0)
    byte = torch.tensor([[0x21, 0xF9, 0x87]], dtype=torch.uint8).view(torch.int8)
    vals = unpack_fp4(byte)
    assert vals[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert vals[0, 4].item() == 6.0 and vals[0, 5].item() == 0.0 and torch.signbit(vals[0, 5])


def test_fp4_dequantization_applies_one_scale_per_32_inputs_on_an_odd_row_count():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 64), generator=g)
    scale = e8m0([[120, 130], [1, 127], [127, 254]])
    got = dequant_fp4(pack_fp4(codes), scale)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    want = table[codes] * e8m0_to_float(scale).repeat_interleave(32, 1)
    assert torch.equal(got, want)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), table[codes])


def test_e2m1_rounding_breaks_ties_to_the_even_code():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.26, 2.6])
    assert round_e2m1(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.5, 3.0]


def test_power_of_two_ceiling_is_exact_at_powers_of_two():
    v = torch.tensor([1.0, 1.0000001, 0.75, 2.0**-20, 3.0])
    assert pow2_ceil(v).tolist() == [1.0, 2.0, 1.0, 2.0**-20, 4.0]


def test_q8_values_are_e4m3_times_the_block_scale():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=g) * 3
    y = q8_pow2(x, 32)
    blocks = x.view(5, 3, 32)
    s = pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0)
    codes = (y.view(5, 3, 32) / s)
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # on the e4m3 grid
    assert (codes.abs() <= 448).all()
    assert torch.equal(y.to(torch.bfloat16).float(), y)  # exact in bf16
    assert ((y - x).abs() <= s.repeat_interleave(32, -1).view(5, 96) * 16).all()


def test_q4_quantizers_land_on_the_e2m1_grid_of_their_scale():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    xb = x.view(4, -1, 32)
    s8 = pow2_ceil(xb.abs().amax(-1, keepdim=True) / 6.0)  # E8M0 rule
    y8 = q4_e8m0(x, 32).view(4, -1, 32)
    assert torch.equal(round_e2m1(y8 / s8), y8 / s8)
    xb = x.view(4, -1, 16)
    s4 = (xb.abs().amax(-1, keepdim=True) / 6.0).to(torch.float8_e4m3fn).float()  # e4m3 scale
    y4 = q4_e4m3(x, 16).view(4, -1, 16)
    assert torch.equal(y4, round_e2m1(xb / s4) * s4)
    assert torch.equal(y4.to(torch.bfloat16).float(), y4)


def test_a_zero_of_either_sign_is_fp4_code_0_and_encoded_weights_round_trip():
    s = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(s)
    w = torch.randn(6, 64, generator=g)
    w[0, :32] = 0.0
    w[1, :32] = -1e-9  # beside a large value of its block these round to -0 in e2m1
    w[1, 0] = 5.0
    packed, scale = encode_fp4(w)
    assert torch.all(packed[0, :16] == 0) and torch.all(packed[1, 1:16] == 0), f"seed {s}: zeros must be code 0"
    assert torch.equal(e2m1_codes(torch.tensor([0.0, -0.0, -0.5, 6.0])), torch.tensor([0, 0, 9, 7]))
    want = (round_e2m1(w.view(6, 2, 32) / e8m0_to_float(scale).unsqueeze(-1)) * e8m0_to_float(scale).unsqueeze(-1))
    assert torch.equal(dequant_fp4(packed, scale), want.view(6, 64)), f"seed {s}"
    data, scale8 = encode_fp8(w, (4, 32))
    per = e8m0_to_float(scale8).repeat_interleave(4, 0)[:6].repeat_interleave(32, 1)
    assert torch.equal(dequant_fp8(data, scale8, (4, 32)), (w / per).to(torch.float8_e4m3fn).float() * per), s
    assert (w.abs().view(6, 2, 32).amax(-1) / e8m0_to_float(scale8).repeat_interleave(4, 0)[:6] <= 448).all(), s
    assert torch.equal(e8m0_from_pow2(torch.tensor([1.0, 0.5, 2.0**-20])).view(torch.uint8),
                       torch.tensor([127, 126, 107], dtype=torch.uint8))
