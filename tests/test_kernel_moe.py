"""The few-token MoE kernels: the router (sqrt-softplus / sigmoid / softmax scores, bias, top-k, normalized
and scaled weights, hash routing) and the grouped experts (SwiGLU with clamps, weight before or after w2,
plus the shared expert), against the references.

Tolerance: router weights within 2^-21 relative (torch's float32 score functions and sums differ from the
correctly rounded ones by an ulp), indices equal; expert outputs within 2^-20 of the largest output for
float32 and one bfloat16 rounding for bfloat16 (an ulp in silu can flip a later rounding)."""

import pytest
import torch

from kernels import moe
from kernels.bench import fp4_weight, fp8_weight

from .kernel_check import DEVICE, assert_close, assert_equal, requires_cuda, run, seed

W_TOL = 2.0**-21
TOL = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7}


def by_expert(w, idx):
    """Route outputs in expert order (topk's order among its k picks is not part of the contract)."""
    order = idx.argsort(-1)
    return w.gather(-1, order), idx.gather(-1, order)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_kernel_matches_the_reference(score_func):
    s = seed()
    m, d, e, k = 5, 96, 23, 4
    gate64 = (torch.randn(d, e, device=DEVICE) / d**0.5).to(torch.bfloat16).double()
    bias = torch.randn(e, device=DEVICE) * 0.1
    x = torch.randn(m, d, device=DEVICE)
    want = by_expert(*moe.route(x, gate64, bias, k, score_func, 1.5, 1e-20))
    got = by_expert(*run(moe.fast_route, x, gate64, bias, k, score_func, 1.5, 1e-20))
    ctx = f"(seed {s}, {score_func})"
    assert_equal("indices", want[1], got[1], ctx)
    assert_close("weights", want[0], got[0], W_TOL, context=ctx)


def test_router_kernel_follows_the_hash_table_rows():
    s = seed()
    m, d, e, k = 4, 64, 9, 3
    gate64 = torch.randn(d, e, device=DEVICE).double()  # not exact in bf16: read as float32/float64
    hidx = torch.stack([torch.randperm(e, device=DEVICE)[:k] for _ in range(m)])
    x = torch.randn(m, d, device=DEVICE)
    want = moe.route(x, gate64, None, k, "sqrtsoftplus", 1.5, 0.0, hidx)
    got = run(moe.fast_route, x, gate64, None, k, "sqrtsoftplus", 1.5, 0.0, hidx)
    assert_equal("indices", want[1], got[1], f"(seed {s})")
    assert_close("weights", want[0], got[0], W_TOL, context=f"(seed {s})")


def experts_for(n_experts, d, inter, fmt, device, held=None):
    def one():
        if fmt == "fp4":
            return fp4_weight(inter, d, device, 2.0), fp4_weight(d, inter, device), fp4_weight(inter, d, device, 2.0)
        b = (32, 32)
        up = fp8_weight(inter, d, b, device, 2.0)
        return up, fp8_weight(d, inter, b, device), fp8_weight(inter, d, b, device, 2.0)

    return [one() if held is None or e in held else None for e in range(n_experts)]


def check_experts(m, d, inter, n_experts, k, fmt, dt, weight_before_w2, with_shared, limit, device=DEVICE):
    s = seed()
    idx = torch.stack([torch.randperm(n_experts, device=device)[:k] for _ in range(m)])
    idx[-1] = idx[0]  # two rows choose the same experts: each expert's weights serve both
    experts = experts_for(n_experts, d, inter, fmt, device, set(idx.flatten().tolist()))
    shared = experts_for(1, d, inter, "fp8", device)[0] if with_shared else None
    x = torch.randn(m, d, device=device).to(dt)
    w = torch.rand(m, k, device=device) + 0.1
    want = moe.reference(x, w, idx, experts, shared, 32, limit, weight_before_w2)
    got = run(moe.fast, x, w, idx, experts, shared, 32, limit, weight_before_w2)
    assert_close("y", want, got, TOL[dt], context=f"(seed {s}, M={m} D={d} I={inter} E={n_experts} k={k} {fmt} "
                                                  f"{dt} before_w2={weight_before_w2} shared={with_shared})")


@pytest.mark.parametrize("m,d,inter,e,k,fmt,dt,before,shared,limit", [
    (5, 96, 64, 7, 2, "fp4", torch.float32, True, True, 10.0),
    (3, 64, 96, 5, 3, "fp8", torch.bfloat16, False, True, 0.0),
    (1, 128, 32, 9, 2, "fp4", torch.bfloat16, True, False, 2.0),
])
def test_moe_kernels_match_the_reference(m, d, inter, e, k, fmt, dt, before, shared, limit):
    check_experts(m, d, inter, e, k, fmt, dt, before, shared, limit)


def test_moe_kernel_refuses_weights_that_do_not_match_the_indices():
    experts = experts_for(3, 64, 32, "fp4", DEVICE)
    with pytest.raises(ValueError, match=r"weights.shape=\(2, 3\): must equal indices.shape \(2, 2\)"):
        moe.fast(torch.zeros(2, 64, device=DEVICE), torch.zeros(2, 3, device=DEVICE),
                 torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), experts, None, 32, 10.0, True)


@requires_cuda
class TestMoeAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_moe_kernels_match_the_reference_at_v41_shapes(self, m):
        dev = torch.device("cuda")
        check_experts(m, 5120, 2304, 384, 6, "fp4", torch.bfloat16, True, True, 10.0, dev)
        gate64 = (torch.randn(5120, 384, device=dev) / 5120**0.5).to(torch.bfloat16).double()
        bias = torch.randn(384, device=dev) * 0.1
        x = torch.randn(m, 5120, device=dev).to(torch.bfloat16)
        want = by_expert(*moe.route(x, gate64, bias, 6, "sqrtsoftplus", 1.5, 1e-20))
        got = by_expert(*run(moe.fast_route, x, gate64, bias, 6, "sqrtsoftplus", 1.5, 1e-20))
        assert_equal("indices", want[1], got[1])
        assert_close("weights", want[0], got[0], W_TOL)
