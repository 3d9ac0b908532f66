"""The rank-order sum of float32 partials (kernels/rank_sum.py): one launch, bitwise the torch adds in rank
order, for any number of ranks up to eight, and a clear error for what it cannot take. The symmetric-memory
form's kernels (a partial published by its product's kernel or by a launch of its own, the consumer's wait)
over one rank, here and on a GPU (symmetric memory, system-scope atomics, a captured graph: what the one GPU
of a device check can run of it)."""

import pytest
import torch
import torch.distributed as dist

from appliance.parallel.collectives import SymmSum
from kernels import bench, linear, rank_sum

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


def one_rank_sums(device: torch.device, graph: bool = False) -> dict[str, bool]:
    """parallel/collectives.py SymmSum over one rank on `device` (its own slots and flags: each wait is met by
    its own publish, the launch ahead): a product published by the linear kernel (the attention's output
    product's form) and one published by a launch of its own, each summed by the waiting consumer, five calls
    each (the slots in turn); with `graph` (CUDA) three calls captured and replayed four times on fresh inputs.
    Each against the product unpublished, bit for bit."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        w = bench.fp8_weight(256, 128, (128, 128), device)
        symm = SymmSum(1, 0, 8 * 256, device)

        def product(x):
            return linear.fast(x, w, 128, torch.float32)

        def published(x):  # the product's kernel publishes its partial
            return symm.produced_into((x.shape[0], 256), lambda to: linear.fast(x, w, 128, torch.float32,
                                                                                 publish=to), rank_sum.fast)

        xs = [torch.randn(r, 128, device=device).bfloat16() for r in (1, 3, 6, 2, 1)]
        out = {"by the product": all(torch.equal(published(x), product(x)) for x in xs),
               "by a launch": all(torch.equal(symm.into(product(x), rank_sum.fast), product(x)) for x in xs)}
        if graph:
            static = [torch.randn(r, 128, device=device).bfloat16() for r in (1, 3, 6)]
            for x in static:  # compiled before the capture
                published(x)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                sums = [published(x) for x in static]
            replays = []
            for _ in range(4):
                for x in static:
                    x.copy_(torch.randn(x.shape, device=device).bfloat16())
                g.replay()
                replays.append(all(torch.equal(s, product(x)) for s, x in zip(sums, static)))
            out["in a graph"] = all(replays)
        return out
    finally:
        if owned:
            dist.destroy_process_group()


def test_one_rank_runs_the_symmetric_sum_s_kernels_published_by_a_product_and_by_a_launch():
    seed()
    sums = one_rank_sums(DEVICE)
    assert all(sums.values()), sums


@pytest.mark.skipif(not torch.cuda.is_available(), reason="symmetric memory and CUDA graphs need a GPU")
class TestSymmetricSumOnCuda:
    def test_a_captured_graph_replays_the_published_sums_on_fresh_inputs(self):
        seed()
        sums = one_rank_sums(torch.device("cuda"), graph=True)
        assert all(sums.values()), sums
