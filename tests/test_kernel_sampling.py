"""The sampling kernels: the truncated distribution (temperature, top-k, top-p), the exponential-race draw
from the same generator, and greedy argmax. Tolerance: probabilities within 2^-21 of the largest (an ulp
of torch's float32 softmax), the same entries kept, the same draws."""

import pytest
import torch

from kernels import sampling

from .kernel_check import DEVICE, assert_close, assert_equal, requires_cuda, run, seed

P_TOL = 2.0**-21


def check(rows, vocab, temperature, top_k, top_p, device=DEVICE):
    s = seed()
    logits = torch.randn(rows, vocab, device=device) * 3
    ctx = f"(seed {s}, V={vocab} T={temperature} top_k={top_k} top_p={top_p})"
    want = sampling.distribution(logits, temperature, top_k, top_p)
    got = run(sampling.fast_distribution, logits, temperature, top_k, top_p)
    assert_equal("kept entries", want > 0, got > 0, ctx)
    assert_close("p", want, got, P_TOL, context=ctx)
    g1 = torch.Generator(device=device).manual_seed(s)
    g2 = torch.Generator(device=device).manual_seed(s)
    assert_equal("draws", sampling.sample(logits, temperature, top_k, top_p, g1),
                 run(sampling.fast_sample, logits, temperature, top_k, top_p, g2), ctx)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 50, 0.8)])
def test_sampling_kernels_match_the_reference(temperature, top_k, top_p):
    check(3, 1000, temperature, top_k, top_p)


def test_greedy_sampling_takes_the_lowest_id_among_equal_maxima():
    s = seed()
    logits = torch.randn(4, 301, device=DEVICE)
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1
    assert_equal("argmax", sampling.sample(logits, 0, 0, 1.0, None), run(sampling.fast_sample, logits, 0, 0, 1.0, None),
                 f"(seed {s})")


@requires_cuda
class TestSamplingAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_sampling_kernels_match_the_reference_at_v41_shapes(self, m):
        check(m, 129280, 0.8, 0, 0.95, torch.device("cuda"))
        check(m, 129280, 1.0, 40, 1.0, torch.device("cuda"))
