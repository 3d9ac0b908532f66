"""The few-token MoE kernels: the router (sqrt-softplus / sigmoid / softmax scores, bias, top-k, normalized
and scaled weights, hash routing) and the grouped experts (SwiGLU with clamps, weight before or after w2,
plus the shared expert), against the references.

Tolerance (kernels/moe.py): router weights within 2^-20 relative (float32 score functions), indices equal;
expert outputs within 2^-12 of the largest output for float32 and 2^-6 for bfloat16 (a float32 GEMM sum can
move an FP8 code of h by one e4m3 step). Rows together equal rows one at a time, bit for bit; a row of NaN
logits still selects k distinct experts in range."""

import pytest
import torch

from kernels import moe
from kernels.bench import dense_weight, fp4_weight, fp8_weight
from kernels.linear import PackedWeight

from .kernel_check import DEVICE, assert_close, assert_equal, assert_rows_invariant, requires_cuda, run, seed

W_TOL = 2.0**-20
TOL = {torch.float32: 2.0**-12, torch.bfloat16: 2.0**-6}


def by_expert(w, idx):
    """Route outputs in expert order (topk's order among its k picks is not part of the contract)."""
    order = idx.argsort(-1)
    return w.gather(-1, order), idx.gather(-1, order)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_kernel_matches_the_reference(score_func):
    s = seed()
    m, d, e, k = 5, 96, 23, 4
    gate = dense_weight(e, d, torch.bfloat16, DEVICE)
    bias = torch.randn(e, device=DEVICE) * 0.1
    x = torch.randn(m, d, device=DEVICE)
    want = by_expert(*moe.route(x, gate, bias, k, score_func, 1.5, 1e-20))
    got = by_expert(*run(moe.fast_route, x, gate, bias, k, score_func, 1.5, 1e-20))
    ctx = f"(seed {s}, {score_func})"
    assert_equal("indices", want[1], got[1], ctx)
    assert_close("weights", want[0], got[0], W_TOL, context=ctx)


def test_router_kernel_follows_the_hash_table_rows():
    s = seed()
    m, d, e, k = 4, 64, 9, 3
    gate = PackedWeight("gate", (e, d), "dense", torch.randn(e, d, device=DEVICE))  # float32: not bf16 values
    hidx = torch.stack([torch.randperm(e, device=DEVICE)[:k] for _ in range(m)])
    x = torch.randn(m, d, device=DEVICE)
    want = moe.route(x, gate, None, k, "sqrtsoftplus", 1.5, 0.0, hidx)
    got = run(moe.fast_route, x, gate, None, k, "sqrtsoftplus", 1.5, 0.0, hidx)
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


def test_moe_rows_do_not_depend_on_the_other_rows():
    s = seed()
    e, k, d, inter = 6, 2, 64, 64
    gate = dense_weight(e, d, torch.bfloat16, DEVICE)
    bias = torch.randn(e, device=DEVICE) * 0.1
    x = torch.randn(6, d, device=DEVICE)
    ctx = f"(seed {s})"
    for i, name in enumerate(("route weights", "route indices")):
        assert_rows_invariant(name, lambda sl, i=i: run(moe.fast_route, x[sl], gate, bias, k, "sqrtsoftplus", 1.5,
                                                        1e-20)[i], context=ctx)
    idx = torch.stack([torch.randperm(e, device=DEVICE)[:k] for _ in range(6)])
    idx[3] = idx[1]  # rows sharing experts
    experts = experts_for(e, d, inter, "fp4", DEVICE)
    shared = experts_for(1, d, inter, "fp8", DEVICE)[0]
    w = torch.rand(6, k, device=DEVICE) + 0.1
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        assert_rows_invariant(f"experts {dt}", lambda sl, xd=xd: run(moe.fast, xd[sl], w[sl], idx[sl], experts, shared,
                                                                     32, 10.0, True), context=ctx)


def test_a_router_row_of_nans_selects_distinct_experts_in_range():
    gate = dense_weight(23, 64, torch.bfloat16, DEVICE)
    x = torch.randn(3, 64, device=DEVICE)
    x[1] = float("nan")
    for score_func in ("sqrtsoftplus", "sigmoid", "softmax"):
        for bias in (None, torch.randn(23, device=DEVICE)):
            _, idx = run(moe.fast_route, x, gate, bias, 6, score_func, 1.5, 1e-20)
            assert ((idx >= 0) & (idx < 23)).all(), f"{score_func}: expert ids out of range: {idx.tolist()}"
            assert all(len(set(r)) == 6 for r in idx.tolist()), f"{score_func}: repeated expert ids: {idx.tolist()}"


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
        gate = dense_weight(384, 5120, torch.bfloat16, dev)
        bias = torch.randn(384, device=dev) * 0.1
        x = torch.randn(m, 5120, device=dev).to(torch.bfloat16)
        want = by_expert(*moe.route(x, gate, bias, 6, "sqrtsoftplus", 1.5, 1e-20))
        got = by_expert(*run(moe.fast_route, x, gate, bias, 6, "sqrtsoftplus", 1.5, 1e-20))
        assert_equal("indices", want[1], got[1])
        assert_close("weights", want[0], got[0], W_TOL)
