"""The rank-order sum of float32 partials (kernels/rank_sum.py): one launch, bitwise the torch adds in rank
order, for any number of ranks up to eight, and a clear error for what it cannot take."""

import pytest
import torch

from kernels import rank_sum

from .kernel_check import DEVICE, assert_equal, run, seed


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_the_kernel_adds_the_partials_in_rank_order_bitwise(world):
    s = seed()
    n = int(torch.randint(1000, 9000, ()).item())  # enough elements that some order of adds shows
    # magnitudes from 1e-8 to 1e8 in one row: any other order of the adds rounds differently somewhere
    parts = [(torch.randn(n) * torch.logspace(-8, 8, n)[torch.randperm(n)]).to(DEVICE) for _ in range(world)]
    want = parts[0].clone()
    for p in parts[1:]:
        want = want + p
    got = run(rank_sum.fast, parts)
    assert_equal("sum", want, got, f"(seed {s}, world {world}, n {n})")
    assert_equal("reference", want, rank_sum.reference(parts), f"(seed {s})")
    if world > 2:
        swapped = [parts[1], parts[0], *parts[2:]]
        assert not torch.equal(run(rank_sum.fast, swapped[::-1]), got), "the order of the ranks must show"


@pytest.mark.parametrize("out_dtype,round_to", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
def test_the_sum_is_rounded_once_where_asked(out_dtype, round_to):
    s = seed()
    parts = [torch.randn(3000, device=DEVICE) * 100 for _ in range(4)]
    want = rank_sum.reference(parts, out_dtype, round_to)
    got = run(rank_sum.fast, parts, out_dtype, round_to)
    assert got.dtype == out_dtype
    assert_equal("rounded sum", want, got, f"(seed {s})")
    exact = rank_sum.reference(parts)
    assert not torch.equal(got.float(), exact), "nothing was rounded"


def test_bad_partials_are_refused_naming_the_argument():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"len\(parts\)=9"):
        rank_sum.fast([x] * 9)
    with pytest.raises(ValueError, match=r"parts\[1\]\.shape"):
        rank_sum.fast([x, x[:2]])
    with pytest.raises(TypeError, match=r"parts\[0\]\.dtype=bfloat16"):
        rank_sum.fast([x.bfloat16()] * 2)
    with pytest.raises(ValueError, match=r"parts\[1\]\.is_contiguous\(\)"):
        rank_sum.fast([x, torch.zeros(8, 4, device=DEVICE).t()])
