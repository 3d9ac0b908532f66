"""The lightning-indexer kernels: scores (with the official bf16 roundings), top-k selection with the
reference's tie rule (exact ties go to the lower row), and V4.1's candidate blocks, the scores of their rows
and the selection among them (against a selection over all rows with the others masked).

Tolerance (kernels/indexer.py): float32 operands, no rounding: 2^-22 of the largest score (float32 sums);
with a round_dtype: one rounding of it (relative to the largest score). Selections and masks: equal. Batch
invariance: rows together equal rows one at a time, and more keys (a longer reach) leave the scores of the
first keys as they were, bit for bit."""

import pytest
import torch

from appliance.model.deepseek_v41 import blocks_by_maxima
from kernels import indexer
from kernels.formats import q4_e8m0
from kernels.registry import FAST, REFERENCE

from .kernel_check import DEVICE, assert_close, assert_equal, assert_rows_invariant, bits, requires_cuda, run, seed

TOL = {None: 2.0**-22, torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}


def inputs(m, nh, di, n, dt, device, quantized):
    q = torch.randn(m, nh, di, device=device)
    keys = torch.randn(n, di, device=device)
    if quantized:  # official numerics: FP4 with E8M0 scales per 32
        q, keys = q4_e8m0(q, 32), q4_e8m0(keys, 32)
    w = (torch.randn(m, nh, device=device) * 2.0**-6).to(dt)
    nv = torch.randint(0, n + 1, (m,), device=device)
    nv[0] = n
    return q.to(dt), w, keys.to(dt), nv - 1  # positions: ratio 1, a query at p sees p + 1 rows


def check_scores(m, nh, di, n, dt, rd, quantized, device=DEVICE):
    s = seed()
    q, w, keys, pos = inputs(m, nh, di, n, dt, device, quantized)
    want = indexer.scores(q, w, keys, pos, 1, rd)
    got = run(indexer.fast_scores, q, w, keys, pos, 1, rd)
    ctx = f"(seed {s}, M={m} nh={nh} dI={di} N={n} {dt} round={rd} quantized={quantized})"
    assert_close("scores", want, got, TOL[rd], context=ctx)
    return want


@pytest.mark.parametrize("m,nh,di,n,dt,rd,quantized", [
    (5, 6, 40, 77, torch.float32, None, False),
    (3, 4, 64, 130, torch.float32, torch.bfloat16, True),
    (2, 3, 32, 50, torch.bfloat16, torch.bfloat16, True),
])
def test_index_scores_kernel_matches_the_reference(m, nh, di, n, dt, rd, quantized):
    check_scores(m, nh, di, n, dt, rd, quantized)


@pytest.mark.parametrize("dt,rd,quantized", [(torch.float32, None, False), (torch.bfloat16, torch.bfloat16, True)])
def test_index_scores_do_not_depend_on_the_other_rows_or_on_the_reach(dt, rd, quantized):
    s = seed()
    q, w, keys, pos = inputs(6, 4, 32, 300, dt, DEVICE, quantized)
    pos = pos.clamp(max=199)
    ctx = f"(seed {s}, {dt} round={rd})"
    assert_rows_invariant("scores", lambda sl: run(indexer.fast_scores, q[sl], w[sl], keys[:200], pos[sl], 1, rd),
                          context=ctx)
    short = run(indexer.fast_scores, q, w, keys[:200], pos, 1, rd)
    long = run(indexer.fast_scores, q, w, keys, pos, 1, rd)[:, :200]
    assert torch.equal(bits(short), bits(long)), f"more keys changed the scores of the first ones {ctx}"
    sc = torch.where(torch.rand_like(short) < 0.3, 0.0, short)  # ties
    assert_rows_invariant("select", lambda sl: run(indexer.fast_select, sc[sl].contiguous(), 37)[0], context=ctx)
    assert_rows_invariant("select with candidates", lambda sl: run(indexer.fast_select, sc[sl].contiguous(), 37,
                                                                   pos[sl], 1, 4, 9)[0], context=ctx)


def test_top_k_selection_matches_the_reference_including_ties_and_unselectable_rows():
    s = seed()
    sc = torch.randn(5, 90, device=DEVICE)
    sc[:, ::3] = 0.0  # many exact ties (the ReLU's zeros), at and around the k-th value
    sc[1, 5] = -0.0
    sc[2] = torch.where(torch.arange(90, device=DEVICE) < 20, sc[2], float("-inf"))  # fewer valid than k
    sc[3] = float("-inf")
    sc[4] = 1.0  # all tied
    for k in (0, 1, 7, 33, 90, 200):
        assert_equal(f"select k={k}", indexer.select(sc, k)[0], run(indexer.fast_select, sc, k)[0], f"(seed {s})")


def blocks_mask(kept: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Kept blocks [M, B] (-1 unused) -> bool [M, n] over their rows: the mask a re-indexing layer applies."""
    mask = torch.zeros(kept.shape[0], n + block, dtype=torch.bool, device=kept.device)
    for m, b in (kept >= 0).nonzero().tolist():
        r = kept[m, b].item() * block
        mask[m, r: r + block] = True
    return mask[:, :n]


@pytest.mark.parametrize("dt,rd", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_candidate_blocks_and_the_selection_inside_them_match_the_reference(dt, rd):
    """The source layer's candidate blocks and top-k; a later layer's scores of the rows of those blocks (the
    bits of its scores over all rows) and its top-k among them, which equals the top-k over all rows with
    the rows outside the blocks masked (ties included: quantized operands, many zero scores)."""
    s = seed()
    n = 61
    nv = torch.tensor([0, 5, 61, 33, 1], device=DEVICE)
    sc = torch.randn(5, n, device=DEVICE)
    sc[:, ::4] = 0.0
    sc = sc.masked_fill(torch.arange(n, device=DEVICE)[None] >= nv[:, None], float("-inf"))
    q, w, keys, _ = inputs(5, 4, 32, n, dt, DEVICE, quantized=True)
    pos = nv - 1
    later = indexer.scores(q, w, keys, pos, 1, rd)
    fast_later = run(indexer.fast_scores, q, w, keys, pos, 1, rd)
    for block, top in ((4, 3), (8, 100), (1, 5), (3, 30)):
        ctx = f"(seed {s}, {dt}, block={block} top={top})"
        want, kept = indexer.select(sc, 7, pos, 1, block, top)
        got, fast_kept = run(indexer.fast_select, sc, 7, pos, 1, block, top)
        assert_equal("candidate blocks", kept, fast_kept, ctx)
        assert_equal("select at the source", want, got, ctx)
        masked = indexer.select(later.masked_fill(~blocks_mask(kept, block, n), float("-inf")), 7)[0]
        inside = indexer.scores(q, w, keys, pos, 1, rd, inside=kept, block=block)
        fast_inside = run(indexer.fast_scores, q, w, keys, pos, 1, rd, inside=kept, block=block)
        rows = indexer.inside_rows(kept, block)
        there = (rows >= 0) & (rows < n)
        full = fast_later.gather(1, rows.clamp(0, n - 1)).masked_fill(~there, float("-inf"))
        assert torch.equal(bits(full), bits(fast_inside)), f"scores inside the blocks are not those of all rows {ctx}"
        assert_close("scores inside", inside, fast_inside, TOL[rd], context=ctx)
        assert_equal("select inside (reference)", masked,
                     indexer.select(inside, 7, block=block, inside=kept)[0], ctx)
        assert_equal("select inside", masked, run(indexer.fast_select, fast_inside, 7, block=block, inside=kept)[0],
                     ctx)


@pytest.mark.parametrize("dt,rd", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_block_maxima_are_the_largest_scores_of_their_blocks(dt, rd):
    s = seed()
    q, w, keys, pos = inputs(5, 4, 32, 203, dt, DEVICE, quantized=True)
    fast_all = run(indexer.fast_scores, q, w, keys, pos, 1, rd)
    for block in (1, 4, 8, 32):
        ctx = f"(seed {s}, {dt}, block={block})"
        want = indexer.scores(q, w, keys, pos, 1, rd, maxima=block)
        got = run(indexer.fast_scores, q, w, keys, pos, 1, rd, maxima=block)
        padded = torch.nn.functional.pad(fast_all, (0, -203 % block), value=float("-inf"))
        assert torch.equal(bits(padded.view(5, -1, block).amax(-1)), bits(got)), f"not the kernel's scores' {ctx}"
        assert_close("block maxima", want, got, TOL[rd], context=ctx)


@pytest.mark.parametrize("ops", [REFERENCE, FAST], ids=["reference", "fast"])
def test_a_selection_by_block_maxima_picks_what_the_selection_over_all_rows_picks(ops):
    """A long call's indexer (appliance/model/deepseek_v41.py blocks_by_maxima): blocks by their largest
    score, then the rows inside them; equal to selecting over all rows, ties across blocks included (rows
    repeated further on score the same), at a source (its candidate blocks too) and elsewhere."""
    s = seed()
    n, k, block = 300, 5, 4
    q, w, keys, pos = inputs(7, 4, 32, n, torch.bfloat16, DEVICE, quantized=True)
    keys[150:] = keys[:150]  # every score tied with one 150 rows on
    pos[1], pos[2] = -1, 10  # a query with no valid row, one with a few
    rd = torch.bfloat16
    full = ops.index_scores(q, w, keys, pos, 1, rd)
    for top_blocks in (0, 12):
        ctx = f"(seed {s}, top_blocks={top_blocks})"
        want, want_made = ops.index_select(full, k, pos, 1, block=block, top_blocks=top_blocks)
        inside = blocks_by_maxima(ops, q, w, keys, pos, 1, rd, block, k, top_blocks)
        assert inside is not None, f"the keys are enough to select by block maxima {ctx}"
        if top_blocks:
            assert_equal("candidate blocks", want_made, inside, ctx)
        scored = ops.index_scores(q, w, keys, pos, 1, rd, inside=inside, block=block)
        got = ops.index_select(scored, k, block=block, inside=inside)[0][:, :k]
        assert_equal("selection by block maxima", want, got, ctx)
    assert blocks_by_maxima(ops, q, w, keys[:80], pos.clamp(max=79), 1, rd, block, k, 0) is None


def test_index_scores_kernel_refuses_keys_of_another_width():
    q = torch.zeros(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"keys.shape=\(5, 16\): must be \[N, 32\]"):
        indexer.fast_scores(q, torch.zeros(1, 2, device=DEVICE), torch.zeros(5, 16, device=DEVICE),
                            torch.ones(1, dtype=torch.int64, device=DEVICE), 1, None)


@requires_cuda
class TestIndexerAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_indexer_kernels_match_the_references_at_v41_shapes(self, m):
        dev = torch.device("cuda")
        sc = check_scores(m, 32, 128, 40000, torch.bfloat16, torch.bfloat16, True, dev)
        pos = torch.full((m,), 39999, device=dev)
        assert_equal("select", indexer.select(sc, 512)[0], run(indexer.fast_select, sc, 512)[0])
        want, kept = indexer.select(sc, 512, pos, 1, 8, 2048)
        got, fast_kept = run(indexer.fast_select, sc, 512, pos, 1, 8, 2048)
        assert_equal("candidate blocks", kept, fast_kept)
        assert_equal("select at the source", want, got)
