"""Incremental decode equals the full-sequence forward, and rewind restores the state exactly.

The tiny checkpoints have a 16-token window, compression ratios 2/1 (V4.1) and 4/8 (V4) and V4.1
candidate blocks of 4 rows (2 kept), so 150 tokens cross window wraps, compression-group and
candidate-block boundaries many times."""

import pytest
import torch

from .conftest import load

CHUNKS = {"deepseek_v41": (1, 8, 61), "deepseek_v4": (1, 7, 64), "deepseek_v4_0731": (1, 7, 64)}
PROMPT = 32  # the fused kernels' chunk invariance (the interpreter): past the window and two candidate blocks


@pytest.fixture(scope="module", params=sorted(CHUNKS))
def family_model(request, tiny_dirs):
    return request.param, load(tiny_dirs[request.param])


def decode(model, tokens, chunk, prefill, state):
    outs = [model.forward(tokens[s:min(s + chunk, prefill)], state).logits for s in range(0, prefill, chunk)]
    outs += [model.forward(tokens[i:i + 1], state).logits for i in range(prefill, len(tokens))]
    return torch.cat(outs)


def test_chunked_prefill_then_single_steps_equals_the_full_forward(family_model):
    family, lm = family_model
    tokens = torch.randint(0, lm.cfg.vocab_size, (150,))
    full = lm.model.forward(tokens, lm.model.new_state(256)).logits
    for chunk in CHUNKS[family]:
        got = decode(lm.model, tokens, chunk, 100, lm.model.new_state(256))
        assert torch.equal(got, full), f"{family} chunk {chunk}: max |delta| {(got - full).abs().max():.3g}"


def test_rewind_then_redecode_reproduces_logits_and_state(family_model):
    family, lm = family_model
    m = lm.model
    tokens = torch.randint(0, lm.cfg.vocab_size, (90,))
    state = m.new_state(256)
    m.forward(tokens[:60], state)
    snapshot = {k: v.clone() for k, v in state.buffers().items()}
    first = torch.cat([m.forward(tokens[i:i + 1], state).logits for i in range(60, 75)])
    state.rewind(60)
    for name, before in snapshot.items():
        assert torch.equal(state.buffers()[name], before), f"{family}: rewind left {name} changed"
    again = torch.cat([m.forward(tokens[i:i + 1], state).logits for i in range(60, 75)])
    assert torch.equal(first, again)
    other = torch.randint(0, lm.cfg.vocab_size, (15,))
    state.rewind(60)
    m.forward(other, state)  # a different continuation...
    state.rewind(60)  # ...rewound as a block
    assert torch.equal(torch.cat([m.forward(tokens[i:i + 1], state).logits for i in range(60, 75)]), first)


def test_rewind_beyond_the_spare_positions_is_refused_with_a_clear_error(family_model):
    from appliance.errors import StateError

    _, lm = family_model
    state = lm.model.new_state(128, spare=4)
    lm.model.forward(torch.randint(0, lm.cfg.vocab_size, (20,)), state)
    with pytest.raises(StateError, match="only the last 4"):
        state.rewind(10)
    state.rewind(0)  # a full reset is always possible
    assert state.position() == 0


def test_a_committed_chunk_journals_only_its_last_spare_positions_and_rewinds_within_them_exactly(family_model):
    """A prefill chunk commits what it writes (DecodeState.committing): the journal keeps the overwritten
    rows of its last `spare` positions, not of the whole chunk, so the state still rewinds exactly within
    them and refuses, naming the journal, to rewind a committed rewind further back."""
    from appliance.errors import StateError

    family, lm = family_model
    m = lm.model
    tokens = torch.randint(0, lm.cfg.vocab_size, (90,))
    state = m.new_state(256, spare=6)
    m.forward(tokens[:20], state)
    with state.committing(80):
        m.forward(tokens[20:80], state)
    kept = {int(p) for *_, positions, _ in state.journal.entries for p in positions}
    assert kept and min(kept) >= 74, f"{family}: the journal kept positions {sorted(kept)[:4]}..."
    first = m.forward(tokens[80:82], state).logits
    state.rewind(76)
    state.rewind(74)  # twice, as far as the spare reaches from 80
    again = torch.cat([m.forward(tokens[i:i + 1], state).logits for i in range(74, 82)])[-2:]
    assert torch.equal(first, again)
    state.rewind(76)
    with pytest.raises(StateError, match="no write before 74"):
        state.rewind(71)  # within `spare` of the length, below what the chunk journaled


@pytest.mark.slow
def test_on_the_fast_path_a_prompts_prefill_does_not_depend_on_its_chunking(tiny_dirs):
    """Issue 31's chunk invariance on the fused kernels (bfloat16, the interpreter): a 32-token prompt's
    logits and the next steps' are the same bits prefilled in one call or in chunks of a fresh size from 5 to
    16 each run (crossing the window, compression groups and candidate blocks elsewhere): every kernel's tiles
    and sum orders come from its shapes, never from the rows a call holds."""
    lm = load(tiny_dirs["deepseek_v41"], path="fast", dtype="bfloat16")
    tokens = torch.randint(0, lm.cfg.vocab_size, (PROMPT + 4,))
    whole = decode(lm.model, tokens, PROMPT, PROMPT, lm.model.new_state(64))
    chunk = int(torch.randint(5, PROMPT // 2 + 1, ()))
    got = decode(lm.model, tokens, chunk, PROMPT, lm.model.new_state(64))
    assert torch.equal(got, whole), f"chunk {chunk}: max |delta| {(got - whole).abs().max():.3g}"


def test_on_the_block_scaled_mma_a_prefill_of_long_calls_does_not_depend_on_its_chunking(tiny_dirs, monkeypatch):
    """As the session prefills (each chunk inside kernels._triton.long_calls: the weight products in
    programs of 128 rows on the rows staged once, a chunk of a few rows too) on the block-scaled MMA (sm_100
    and later; the interpreter here): a 32-token prompt's logits and the next steps' (short calls) are the
    same bits in one call or in chunks of a fresh size from 5 to 16 each run, and within bfloat16 rounding
    of the same prompt in short calls (32 tokens cross the tiny model's window of 16, its compression groups
    and its 8 candidate rows)."""
    from kernels import linear
    from kernels._triton import long_calls

    from .conftest import use_native_products

    staged = []
    stage = linear.stage_launch
    monkeypatch.setattr(linear, "stage_launch", lambda *a: (staged.append(1), stage(*a))[1])
    use_native_products(monkeypatch, "block-scaled")
    lm = load(tiny_dirs["deepseek_v41"], path="fast", dtype="bfloat16")
    tokens = torch.randint(0, lm.cfg.vocab_size, (PROMPT + 4,))

    def prefill_long(chunk):
        state = lm.model.new_state(64)
        with long_calls():
            outs = [lm.model.forward(tokens[s:min(s + chunk, PROMPT)], state).logits for s in range(0, PROMPT, chunk)]
        outs += [lm.model.forward(tokens[i:i + 1], state).logits for i in range(PROMPT, len(tokens))]
        return torch.cat(outs)

    whole = prefill_long(PROMPT)
    assert staged, "no long call staged its rows"
    chunk = int(torch.randint(5, PROMPT // 2 + 1, ()))
    got = prefill_long(chunk)
    assert torch.equal(got, whole), f"chunk {chunk}: max |delta| {(got - whole).abs().max():.3g}"
    short = decode(lm.model, tokens, PROMPT, PROMPT, lm.model.new_state(64))
    assert (short.float() - whole.float()).abs().max() <= 0.05 * short.float().abs().max()


def test_a_states_constants_give_what_the_aranges_they_replace_give():
    """DecodeState.following, first_collapse and PositionRing.window_slots (a captured cycle's positions, the
    first mHC collapse, a DSpark window's slots) against what they replace, fresh sizes and starts each run:
    past the constants' length they make the same values fresh."""
    from appliance.model.state import FOLLOWING, DecodeState

    streams = int(torch.randint(1, 6, ()))
    state = DecodeState(64, int(torch.randint(0, 8, ())), "cpu", streams)
    start = torch.randint(0, 1 << 20, ())
    for n in (1, int(torch.randint(2, FOLLOWING + 1, ())), FOLLOWING + int(torch.randint(1, 64, ()))):
        assert torch.equal(state.following(start, n), start + torch.arange(n))
        assert torch.equal(state.following(int(start), n), torch.arange(int(start), int(start) + n))
        first = torch.zeros(n, streams)
        first[:, 0] = 1
        assert torch.equal(state.first_collapse(n, streams), first)
    assert torch.equal(state.first_collapse(3, streams + 1)[:, 0], torch.ones(3))
    size = int(torch.randint(2, 200, ()))
    spare = int(torch.randint(0, size, ()))
    ring = DecodeState(64, spare, "cpu").ring("r", size, 4, torch.float32)
    for last in (int(torch.randint(0, size - spare, ())), int(torch.randint(size, 10 * size, ()))):
        want = [p % size if p >= 0 else -1 for p in range(last - ring.reach + 1, last + 1)]
        got = ring.window_slots(torch.tensor(last)).tolist()
        assert [g if g >= 0 else -1 for g in got] == want  # a negative slot is none (attention.window_mask)


def test_a_cycles_buffers_hold_the_positions_and_slots_the_cycle_launched_for():
    """CycleBuffers.load: the positions N-1 .. N+B the host makes, their slots in the speculator's rows ring
    and a DSpark window's slots equal what a cycle made in launches before (following, the remainder,
    window_slots), fresh sizes and N each run; the drafts a draft step left stay; a static call given the
    positions reads views of them."""
    from appliance.decode.cycle import CycleBuffers
    from appliance.model.state import DecodeState, shifted

    def rand(lo, hi):
        return int(torch.randint(lo, hi, ()))

    block, rows_ring, size = rand(1, 9), rand(2, 40), rand(2, 200)
    state = DecodeState(64, rand(0, size), "cpu")
    ring = state.ring("w", size, 4, torch.float32)
    buf = CycleBuffers("cpu", block, 7, rows_ring, (ring.size, ring.reach))
    for N in (1, rand(2, size + 1), rand(size + 1, 1 << 20)):
        anchor, force, drafts = rand(0, 7), rand(-1, block + 1), torch.randint(0, 7, (block,))
        buf.drafts.copy_(drafts)
        buf.load(anchor, N, force)
        q = torch.tensor(N - 1)
        assert torch.equal(buf.positions, state.following(q, block + 2))
        assert (int(buf.positions[1]), int(buf.anchor[0]), int(buf.force)) == (N, anchor, force)
        assert torch.equal(buf.drafts, drafts)
        assert torch.equal(buf.row_slots, buf.positions % rows_ring)
        assert torch.equal(buf.window, ring.window_slots(q))
        given = state.following(buf.positions[1:], block)
        assert given.data_ptr() == buf.positions[1:].data_ptr() and torch.equal(given, state.following(N, block))
        assert torch.equal(shifted(buf.positions, 2), buf.positions[2:]) and int(shifted(q, 2)) == N + 1
