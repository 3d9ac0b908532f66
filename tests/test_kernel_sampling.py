"""The sampling kernels: the truncated distribution (temperature, top-k, top-p, read from a device tensor),
the draw of the shared counter RNG over it (the race in the distribution's launch: the generator's values
drawn inside it, in float32), and greedy argmax. Tolerance (kernels/sampling.py): probabilities within
2^-20 of the largest (float32 exp and sums in another order than torch's), the same entries kept, the same
draws except where the reference's race values of the two entries are within 2^-18 of each other. Rows
together equal rows one at a time, bit for bit."""

import pytest
import torch

from kernels import rank_sum, sampling

from .kernel_check import DEVICE, assert_close, assert_equal, assert_rows_invariant, requires_cuda, run, seed

P_TOL = 2.0**-20
RACE_TOL = 2.0**-18


def assert_same_draws(p, key, want, got, context):
    """want (the float64 reference's draws from p with `key` as it was before) and got agree, or where they
    differ the reference's race values p / E of the two entries are within RACE_TOL of each other."""
    e = -torch.log1p(-sampling.uniform(key.clone(), p.numel()).view(p.shape))
    race = p.double() / e
    for r in (want != got).nonzero()[:, 0].tolist():
        a, b = race[r, want[r]].item(), race[r, got[r]].item()
        assert abs(a - b) <= RACE_TOL * a, (f"row {r}: the kernel drew {got[r].item()} (p/E {b:.9g}), the reference "
                                            f"{want[r].item()} (p/E {a:.9g}): not a near tie {context}")


def params_of(temperature, top_k, top_p, device):
    return torch.tensor([temperature, top_p, float(top_k)], dtype=torch.float32, device=device)


def check(rows, vocab, temperature, top_k, top_p, device=DEVICE):
    s = seed()
    logits = torch.randn(rows, vocab, device=device) * 3
    ctx = f"(seed {s}, V={vocab} T={temperature} top_k={top_k} top_p={top_p})"
    params = params_of(temperature, top_k, top_p, device)
    want = sampling.distribution(logits, params)
    got = run(sampling.fast_distribution, logits, params)
    assert_equal("kept entries", want > 0, got > 0, ctx)
    assert_close("p", want, got, P_TOL, context=ctx)
    k1 = torch.tensor([s, 0], device=device)
    k2, before = k1.clone(), k1.clone()
    assert_same_draws(want, before, sampling.sample(logits, params, k1), run(sampling.fast_sample, logits, params, k2),
                      ctx)
    assert_equal("counter", k1, k2, ctx)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 50, 0.8)])
def test_sampling_kernels_match_the_reference(temperature, top_k, top_p):
    check(3, 1000, temperature, top_k, top_p)


def test_the_sample_kernel_draws_the_references_draws_with_its_own_generator_values():
    """The race inside the distribution's launch over 48 rows, entries without mass among them: the
    reference's draws (but near ties), never an entry without mass, the counter advanced as the reference's."""
    s = seed()
    logits = torch.randn(48, 1500, device=DEVICE) * 2
    logits[:, ::7] = float("-inf")  # no mass: never drawn
    params = params_of(1.0, 0, 1.0, DEVICE)
    key = torch.tensor([s, s % 1000], device=DEVICE)
    k1, k2 = key.clone(), key.clone()
    want, got = sampling.sample(logits, params, k1), run(sampling.fast_sample, logits, params, k2)
    assert_same_draws(sampling.distribution(logits, params), key, want, got, f"(seed {s})")
    assert_equal("counter", k1, k2, f"(seed {s})")
    assert (got % 7 != 0).all(), f"an entry without mass was drawn (seed {s})"
    again = run(sampling.fast_sample, logits, params, k2)
    assert not torch.equal(again, got), f"the advanced counter drew the same 48 tokens again (seed {s})"


def test_a_rows_distribution_and_argmax_do_not_depend_on_the_other_rows():
    s = seed()
    logits = torch.randn(6, 700, device=DEVICE) * 3
    params = params_of(0.8, 20, 0.9, DEVICE)
    assert_rows_invariant("p", lambda sl: run(sampling.fast_distribution, logits[sl], params), context=f"(seed {s})")
    greedy = params_of(0.0, 0, 1.0, DEVICE)
    key = torch.tensor([s, 0], device=DEVICE)
    assert_rows_invariant("argmax", lambda sl: run(sampling.fast_sample, logits[sl], greedy, key),
                          context=f"(seed {s})")


def test_greedy_sampling_takes_the_lowest_id_among_equal_maxima():
    s = seed()
    logits = torch.randn(4, 301, device=DEVICE)
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1
    params = params_of(0.0, 0, 1.0, DEVICE)
    key = torch.tensor([s, 0], device=DEVICE)
    got = run(sampling.fast_sample, logits, params, key.clone())
    assert_equal("argmax", sampling.sample(logits, params, key), got, f"(seed {s})")
    assert got[1].item() == 7


@pytest.mark.parametrize("temperature,gather", [(0.0, True), (0.9, True), (1.2, False)])
def test_the_markov_step_kernel_adds_samples_and_gathers_as_the_reference(temperature, gather):
    """DSpark's Markov step in one launch: the sum the reference's torch.add gives bit for bit, kept in the
    caller's row; its draw (but near ties) and counter; the drawn token's table row in the next step's row of
    a wider buffer (its neighbours untouched); base a row of a larger block as the drafter passes it."""
    s = seed()
    vocab, width = int(torch.randint(200, 900, ())), int(torch.randint(3, 40, ()))
    base = torch.randn(5, vocab, device=DEVICE) * 2
    addend = torch.randn(1, vocab, device=DEVICE)
    table = torch.randn(vocab, width, device=DEVICE)
    params, ctx = params_of(temperature, 0, 0.95, DEVICE), f"(seed {s}, T={temperature}, V={vocab}, W={width})"
    got = []
    for sample_sum in (sampling.sample_sum, sampling.fast_sample_sum):
        key = torch.tensor([s, 11], device=DEVICE)
        ids = torch.full((3,), -7, dtype=torch.long, device=DEVICE)
        total = torch.full((2, vocab), float("nan"), device=DEVICE)
        rows = torch.full((2, width + 6), -1.0, device=DEVICE)
        run(sample_sum, base[2:3], addend, params, key, ids[1:2], total[1:2], *(
            (table, rows[1:2, 6:]) if gather else ()))
        got.append((ids, total, rows, key))
    (ids, total, rows, key), (f_ids, f_total, f_rows, f_key) = got
    assert_equal("total", total[1], f_total[1], ctx)
    assert torch.equal(total[1], base[2] + addend[0]) and f_total[0].isnan().all(), ctx
    assert_same_draws(sampling.distribution(total[1:2], params), torch.tensor([s, 11], device=DEVICE), ids[1:2],
                      f_ids[1:2], ctx)
    assert (f_ids[0::2] == -7).all(), f"wrote outside out {ctx}"
    assert_equal("counter", key, f_key, ctx)
    if gather:
        assert_equal("next row", table[f_ids[1]], f_rows[1, 6:], ctx)
    assert (f_rows[0] == -1).all() and (f_rows[1, :6] == -1).all() and (gather or (f_rows == -1).all()), ctx
    with pytest.raises(ValueError, match="next_row.shape"):
        run(sampling.fast_sample_sum, base[2:3], addend, params, key, ids[1:2], total[1:2], table, rows[:, 6:])
    with pytest.raises(TypeError, match="addend"):
        run(sampling.fast_sample_sum, base[2:3], addend.double(), params, key, ids[1:2], total[1:2])


@pytest.mark.parametrize("k", [0, 1, 4])
def test_the_accept_kernels_accept_what_the_reference_accepts(k):
    s = seed()
    vocab = 500
    target, draft_logits = torch.randn(k + 1, vocab, device=DEVICE) * 2, torch.randn(k, vocab, device=DEVICE) * 2
    drafts = torch.randint(0, vocab, (k,), device=DEVICE)
    drafts[:2] = target[:2].argmax(-1)[:k]  # a greedy prefix of up to two
    draft_logits[:, drafts[-1:]] += 4  # the drafter likes its last draft: accepted or not, the residual differs
    for temperature in (0.0, 0.9):
        for force in (-1, 1, k + 3):
            params = params_of(temperature, 0, 0.95, DEVICE)
            key = torch.tensor([s, s % 997], device=DEVICE)
            want_key, got_key = key.clone(), key.clone()
            f = torch.tensor(force, device=DEVICE)
            want = sampling.accept(target, drafts, draft_logits, params, want_key, f)
            got = run(sampling.fast_accept, target, drafts, draft_logits, params, got_key, f)
            ctx = f"(seed {s}, k={k}, T={temperature}, force={force})"
            assert_equal("result", want, got, ctx)
            assert_equal("counter", want_key, got_key, ctx)
            j = int(got[1])
            assert int(got[0]) == j + 1 and j == (min(force, k) if force >= 0 else j), ctx
            assert torch.equal(got[2:2 + j], drafts[:j]) and not got[3 + j:].any(), ctx


def test_the_accept_kernel_draws_each_miss_from_the_residual_distribution():
    """Sampled acceptance over many counters: with the drafter sure of a token the target never gives
    (r = 1 there, p = 0) every draft is rejected, and the next token is drawn from the residual, which is p
    itself: the kernel's draws follow the reference's, counter by counter, where the race is not a near tie."""
    s = seed()
    vocab = 64
    target = torch.randn(2, vocab, device=DEVICE)
    target[:, 5] = -1e4
    draft_logits = torch.full((1, vocab), -1e4, device=DEVICE)
    draft_logits[0, 5] = 0.0
    drafts = torch.tensor([5], device=DEVICE)
    params, f = params_of(1.0, 0, 1.0, DEVICE), torch.tensor(-1, device=DEVICE)
    key = torch.tensor([s, 0], device=DEVICE)
    seen = set()
    for _ in range(40):
        before = key.clone()
        want = sampling.accept(target, drafts, draft_logits, params, before.clone(), f)
        got = run(sampling.fast_accept, target, drafts, draft_logits, params, key, f)
        assert int(got[1]) == 0, f"(seed {s}) a draft with p = 0 was accepted"
        residual = sampling.distribution(target[:1], params)
        after_tests = before.clone()
        sampling.uniform(after_tests, 1)  # the acceptance test's value comes first
        if want[2] != got[2]:
            assert_same_draws(residual, after_tests, want[2:3], got[2:3], f"(seed {s}, counter {before[1]})")
        seen.add(int(got[2]))
    assert len(seen) > 5, f"(seed {s}) 40 draws gave {sorted(seen)}"


@requires_cuda
class TestSamplingAtV41ShapesOnCuda:
    @pytest.mark.parametrize("m", [1, 6])
    def test_sampling_kernels_match_the_reference_at_v41_shapes(self, m):
        check(m, 129280, 0.8, 0, 0.95, torch.device("cuda"))
        check(m, 129280, 1.0, 40, 1.0, torch.device("cuda"))


def test_sample_and_accept_write_a_callers_buffer_and_name_a_wrong_one():
    """`out`: the ids land in the caller's buffer (a view into a larger one, as the decode cycle's result), the
    op returns that buffer, the same ids as without it, the neighbours untouched; a wrong buffer is refused
    naming `out`, on both paths."""
    s = seed()
    k, vocab = int(torch.randint(1, 5, ())), int(torch.randint(50, 400, ()))
    logits, draft_logits = torch.randn(k + 1, vocab, device=DEVICE) * 2, torch.randn(k, vocab, device=DEVICE) * 2
    drafts = torch.randint(0, vocab, (k,), device=DEVICE)
    params, f = params_of(0.8, 0, 0.9, DEVICE), torch.tensor(-1, device=DEVICE)
    for sample, accept in ((sampling.sample, sampling.accept), (sampling.fast_sample, sampling.fast_accept)):
        key = torch.tensor([s, 7], device=DEVICE)
        fresh = run(sample, logits, params, key.clone())
        buf = torch.full((k + 5,), -7, dtype=torch.long, device=DEVICE)
        got = run(sample, logits, params, key.clone(), buf[2:k + 3])
        assert got.data_ptr() == buf[2:].data_ptr() and torch.equal(got, fresh), f"(seed {s}) {sample.__name__}"
        assert (buf[:2] == -7).all() and (buf[k + 3:] == -7).all(), f"(seed {s}) {sample.__name__} wrote outside out"
        fresh = run(accept, logits, drafts, draft_logits, params, key.clone(), f)
        got = run(accept, logits, drafts, draft_logits, params, key.clone(), f, buf[1:k + 4])
        assert got.data_ptr() == buf[1:].data_ptr() and torch.equal(got, fresh), f"(seed {s}) {accept.__name__}"
        with pytest.raises(ValueError, match="out.shape"):
            run(sample, logits, params, key.clone(), buf[:k])
        with pytest.raises(ValueError, match="out.shape"):
            run(accept, logits, drafts, draft_logits, params, key.clone(), f, buf[:k])


def split_over_ranks(logits: torch.Tensor, world: int, published: bool) -> sampling.SplitLogits:
    """`logits` [R, V] held by columns over `world` made-up ranks: gathered (plain tensors), or each rank's
    part in the second slot of its symmetric buffer as rank 1 of them sees it after every rank published two
    calls (the first slot NaN: a kernel that read it would draw from NaN)."""
    rows, width = logits.shape[0], logits.shape[1] // world
    parts = [logits[:, r * width:(r + 1) * width].contiguous() for r in range(world)]
    if not published:
        return sampling.SplitLogits(parts)
    n = rows * width
    buffers = [torch.full((rank_sum.SLOTS * n,), float("nan"), device=DEVICE) for _ in range(world)]
    for b, p in zip(buffers, parts):
        b[n:].copy_(p.reshape(-1))
    flags = [torch.tensor([2] * world + [0], device=DEVICE) for _ in range(world)]
    to = rank_sum.Publish(buffers[1], flags, 1)
    return sampling.SplitLogits(rank_sum.Partials([b[:n].view(rows, width) for b in buffers], to))


@pytest.mark.parametrize("published", [False, True])
def test_the_samplers_read_logits_split_over_ranks_where_the_ranks_hold_them(published):
    """A vocabulary-parallel head's logits, held by columns over the ranks (gathered, or in symmetric memory
    read in place after the wait): sample, the Markov step and accept give the ids, counters and sums they
    give for the whole rows, bit for bit, rows sliced as the cycle slices them (the Markov step's base held by
    columns too: gathered, or published through an exchange of its own, DSpark's base); the reference takes
    gathered parts and refuses published ones, naming them, as the Markov step refuses a base published
    through its addend's exchange (one call's slot is found there)."""
    s = seed()
    world, width, k = int(torch.randint(2, 5, ())), int(torch.randint(40, 200, ())), int(torch.randint(1, 5, ()))
    vocab = world * width
    target, draft_logits = torch.randn(k + 1, vocab, device=DEVICE) * 2, torch.randn(k, vocab, device=DEVICE) * 2
    drafts = torch.randint(0, vocab, (k,), device=DEVICE)
    drafts[:1] = target[:1].argmax(-1)
    split = split_over_ranks(target, world, published)
    f, ctx = torch.tensor(-1, device=DEVICE), f"(seed {s}, world {world}, V={vocab}, k={k})"
    assert tuple(split.shape) == (k + 1, vocab) and tuple(split[-1:].shape) == (1, vocab), ctx
    for temperature in (0.0, 0.9):
        params = params_of(temperature, 0, 0.95, DEVICE)
        got = []
        for logits, base in ((target, draft_logits), (split, split_over_ranks(draft_logits, world, published))):
            key = torch.tensor([s, 5], device=DEVICE)
            ids = run(sampling.fast_sample, logits[-1:], params, key)
            total, markov = torch.empty(1, vocab, device=DEVICE), torch.empty(1, dtype=torch.long, device=DEVICE)
            run(sampling.fast_sample_sum, base[:1], logits[1:2], params, key, markov, total)
            accepted = run(sampling.fast_accept, logits, drafts, draft_logits, params, key, f)
            got.append((ids, total, markov, accepted, key))
        for name, want, have in zip(("ids", "sum", "markov ids", "accepted", "counter"), *got):
            assert_equal(name, want, have, f"T={temperature} {ctx}")
    assert torch.equal(got[0][1], draft_logits[:1] + target[1:2]), ctx
    params = params_of(0.0, 0, 1.0, DEVICE)
    ids, total = torch.empty(1, dtype=torch.long, device=DEVICE), torch.empty(1, vocab, device=DEVICE)
    with pytest.raises(ValueError, match="base"):  # a base held by columns takes an addend held so
        sampling.fast_sample_sum(split_over_ranks(draft_logits, world, False)[:1], target[:1], params,
                                 torch.tensor([s, 0], device=DEVICE), ids, total)
    if published:
        with pytest.raises(ValueError, match="logits"):
            sampling.sample(split, params, torch.tensor([s, 0], device=DEVICE))
        with pytest.raises(ValueError, match="base"):
            sampling.fast_sample_sum(split[:1], split[-1:], params, torch.tensor([s, 0], device=DEVICE), ids, total)
    else:
        ids = sampling.sample(split, params, torch.tensor([s, 0], device=DEVICE))
        assert_equal("reference ids", target.argmax(-1), ids, ctx)
