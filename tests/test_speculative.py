"""Speculative decoding is lossless: greedy output with drafting equals plain greedy decoding token for
token, sampled output has the target's distribution, a verified block equals single steps bitwise, and
after cycles with rejected drafts every reader reaches exactly the state plain decoding of the accepted
tokens leaves (a rejected draft's writes stay only where nothing reads them)."""

import dataclasses
import random

import pytest
import torch
from scipy.stats import chisquare

from appliance.api import Request, Sampling
from appliance.cli.tiny_checkpoint import write_tiny
from kernels import embed
from kernels import sampling as sampler

from .conftest import load, open_loop
from .oracle import OracleDrafter

FAMILIES = ("deepseek_v41", "deepseek_v4", "deepseek_v4_0731")


@pytest.fixture(scope="module")
def drafter_models(tiny_dirs):
    return {f: load(tiny_dirs[f], draft="auto") for f in FAMILIES}


def greedy(lm, prompt, n, **kw):
    g = open_loop(lm, **kw)
    ids, done = [], None
    for event in g.run(Request(input_ids=prompt, max_tokens=n, ignore_eos=True)):
        ids += getattr(event, "ids", [])
        done = event
    return ids, done


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_with_drafting_equals_no_drafting_over_128_tokens(drafter_models, family):
    # 128 tokens (the window of 16 wraps eight times over); the long check (BENCHMARKS.md) decodes 128 on the
    # fast path with each drafter
    lm = drafter_models[family]
    prompt = torch.randint(0, lm.cfg.vocab_size, (23,)).tolist()
    want, _ = greedy(lm, prompt, 128)
    # one of the five draft lengths, drawn anew each run (all five cost minutes a family), and adaptive
    for draft, k in [("auto", random.randint(1, 5)), ("adaptive", 5)]:
        got, done = greedy(lm, prompt, 128, draft=draft, draft_tokens=k)
        assert got == want, f"{family} --draft {draft} k={k}: first mismatch at {_first_mismatch(got, want)}"
        assert done.speculative["cycles"] > 0 and done.speculative["drafted"] >= done.speculative["cycles"]


def _first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("family", FAMILIES)
def test_partially_accepted_drafts_still_give_the_plain_greedy_output(drafter_models, family):
    lm = drafter_models[family]
    prompt = torch.randint(0, lm.cfg.vocab_size, (17,)).tolist()
    want, _ = greedy(lm, prompt, 48)
    got, stats = _greedy_with_oracle(lm, lm, prompt, 48)
    assert got == want
    assert stats.accepted > 0 and sum(stats.histogram[1:-1]) > 0, f"no partial acceptance exercised: {stats}"


def _greedy_with_oracle(target, drafts_from, prompt, n):
    """Greedy ids and the session's drafting stats with an oracle drafter (the greedy tokens of
    `drafts_from`, 30% of them corrupted) proposing k=4 drafts a cycle to `target`."""
    oracle = OracleDrafter(drafts_from, corrupt=0.3, seed=random.randrange(1 << 20))
    g = open_loop(dataclasses.replace(target, drafter=oracle), draft="auto", draft_tokens=4)
    oracle.bind(g.session.state)
    ids = []
    for event in g.run(Request(input_ids=prompt, max_tokens=n, ignore_eos=True)):
        ids += getattr(event, "ids", [])
    return ids, g.session.stats


@pytest.mark.slow
def test_on_the_fast_path_partially_accepted_drafts_still_give_the_plain_greedy_output(tiny_dirs, drafter_models):
    """Verify blocks whose drafts are accepted (in part where a corrupted draft ends the run), on the fast
    path: the accepted rows of a k + 1-row verify are the single steps' rows, so the tokens are plain greedy
    decoding's (the tiny models' random drafters are almost never right, so their runs reject nearly every
    draft). The oracle drafts from the reference model (its guesses only decide what is proposed; the fast
    path's verify decides what is kept). Short: the interpreter costs seconds a forward."""
    lm = load(tiny_dirs["deepseek_v41"], path="fast")
    prompt = torch.randint(0, lm.cfg.vocab_size, (15,)).tolist()
    want, _ = greedy(lm, prompt, 16)
    got, stats = _greedy_with_oracle(lm, drafter_models["deepseek_v41"], prompt, 16)
    assert got == want
    assert stats.accepted > 0, f"no draft accepted: {stats}"


def test_an_oracle_drafter_that_proposes_the_targets_own_samples_is_always_accepted(drafter_models):
    lm = drafter_models["deepseek_v4"]
    oracle = OracleDrafter(lm)
    g = open_loop(dataclasses.replace(lm, drafter=oracle), draft="auto", draft_tokens=3)
    oracle.bind(g.session.state)
    req = Request(input_ids=[3, 4, 5, 6], max_tokens=40, ignore_eos=True,
                  sampling=Sampling(temperature=1.0, seed=random.randrange(1 << 30)))
    events = list(g.run(req))
    stats = g.session.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted, stats.as_dict()
    assert type(events[-1]).__name__ == "Done"


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    d = write_tiny(tmp_path_factory.mktemp("v24"), "deepseek_v4_0731", seed=7, vocab=24)
    return load(d, draft="auto")


def _chi2(samples, p, label):
    """No draw outside the (truncated) distribution's support; the draws' counts against p by a chi-square
    test where the expected counts allow one (a truncation can leave a single token carrying nearly all of
    p: then the support is all there is to check)."""
    outside = int((p[samples] == 0).sum())
    assert outside == 0, f"{label}: {outside} draws of tokens outside the distribution's support"
    counts = torch.bincount(samples, minlength=len(p)).double()
    expected = p.double() * len(samples)
    keep = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat((counts[keep], counts[~keep].sum(0, keepdim=True)))
    exp = torch.cat((expected[keep], expected[~keep].sum(0, keepdim=True)))
    if exp[-1] < 5:
        obs = torch.cat((obs[:-2], obs[-2:].sum(0, keepdim=True)))
        exp = torch.cat((exp[:-2], exp[-2:].sum(0, keepdim=True)))
    if len(obs) < 2:  # one bin: nothing for a chi-square to compare
        return
    result = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    assert result.pvalue > 0.001, f"{label}: chi-square p = {result.pvalue:.2g}"


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_k=8), Sampling(1.3, top_p=0.8)],
                         ids=["T1", "T0.7-topk8", "T1.3-topp0.8"])
def test_sampling_with_and_without_drafting_follows_the_target_distribution(small_vocab, sampling):
    """20,000 seeded trials of the device sampler, and of one speculative acceptance (the real DSpark
    drafts of the tiny-vocabulary checkpoint against the target), against the target's softmax."""
    lm, trials = small_vocab, 20000
    model = lm.model
    state = model.new_state(64)
    prompt = torch.randint(0, 24, (12,))
    out = model.forward(prompt, state, logits="last")
    anchor = out.logits[-1:].argmax(-1)
    target = model.forward(anchor, state, logits="last").logits  # L_1: the next token's logits
    params = torch.tensor([sampling.temperature, sampling.top_p, float(sampling.top_k)])
    key = torch.tensor([random.randrange(1 << 40), 0])
    p = sampler.distribution(target, params)[0]
    plain = sampler.draw(p.unsqueeze(0).expand(trials, -1).contiguous(), key)
    _chi2(plain, p, "without drafting")
    state.rewind(12)
    dstate = lm.drafter.new_state(64)
    lm.drafter.commit(dstate, out.hidden[:11], prompt[1:], 0)
    d = lm.drafter.draft(dstate, 11, anchor, out.hidden[11], 3, params, key)
    rows = target.expand(4, -1)  # only the first verify row decides the first token's distribution
    r = sampler.distribution(d.logits, params)
    first = []
    for _ in range(trials):
        drafts = sampler.draw(r, key)  # drafts drawn from the drafter's distribution, as the drafter does
        result = sampler.accept(rows, drafts, d.logits, params, key, torch.tensor(-1))
        first.append(int(result[2]))  # the first token produced: the first draft if accepted, else the next
    _chi2(torch.tensor(first), p, "with drafting")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_block_of_6_rows_equals_6_single_steps_bitwise(drafter_models, family):
    _verify_block_equals_single_steps(drafter_models[family])


def _verify_block_equals_single_steps(lm, prefix=34):
    m = lm.model
    tokens = torch.randint(0, lm.cfg.vocab_size, (prefix + 6,))
    a, b = m.new_state(128), m.new_state(128)
    m.forward(tokens[:prefix], a)
    m.forward(tokens[:prefix], b)
    block = m.forward(tokens[prefix:], a, keep_streams=True)
    singles = [m.forward(tokens[i:i + 1], b, keep_streams=True) for i in range(prefix, prefix + 6)]
    assert torch.equal(block.logits, torch.cat([s.logits for s in singles]))
    if block.hidden is not None:
        assert torch.equal(block.hidden, torch.cat([s.hidden for s in singles]))
    assert torch.equal(block.streams, torch.cat([s.streams for s in singles]))
    for name, t in a.buffers().items():
        assert torch.equal(t, b.buffers()[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_cycles_with_random_accept_lengths_leave_the_plain_decoding_state_where_readers_reach(drafter_models,
                                                                                               family):
    lm = drafter_models[family]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    prompt = torch.randint(0, lm.cfg.vocab_size, (21,)).tolist()
    spec = open_loop(lm, capacity=256, draft="auto", draft_tokens=4).session
    logits = spec.prefill_all(prompt)
    spec.start_sampling(Sampling(), 0)
    committed = list(prompt)
    token = int(logits.argmax())
    for _ in range(25):
        spec.spec.force_accept = rng.randrange(0, 5)
        new = spec.cycle(token)
        committed.append(token)
        committed += new[:-1]
        token = new[-1]
    plain = open_loop(lm, capacity=256, draft="auto", draft_tokens=4).session
    plain.prefill_all(prompt)
    for t in committed[len(prompt):]:  # plain decoding of the accepted tokens, one per step
        out = plain.forward_out([t])
        plain.spec.observe(out, plain.state.length - 1)
    assert spec.state.length == plain.state.length == len(committed)
    for name, t in plain.state.live_buffers().items():
        assert torch.equal(spec.state.live_buffers()[name], t), f"{family} (seed {seed}): target {name}"
    for name, t in plain.spec.state.live_buffers().items():
        assert torch.equal(spec.spec.state.live_buffers()[name], t), f"{family} (seed {seed}): drafter {name}"
    # and the next cycle from either computes the same: the same logits for the same next token
    assert torch.equal(spec.forward_out([token]).logits, plain.forward_out([token]).logits), f"(seed {seed})"


@pytest.mark.parametrize("family", ("deepseek_v41", "deepseek_v4_0731"))
def test_every_dspark_draft_finds_the_key_row_of_its_q_in_the_rings(drafter_models, family):
    """A DSpark draft reads the key row of q = N - 1 without writing it: its last verify committed it (every
    row it made, `commits_ahead`), or, after a prefill, a rewind or a restored checkpoint, `catch_up` did.
    Before every cycle, with random acceptances (all drafts accepted included: q is then the verify's last
    row), then back to an earlier position through the prefix's checkpoints with another token there and on,
    each stage's ring holds at q what the drafter's own commit of the kept target row H(q) writes into a fresh
    state; and the block's noise rows, made at load, stay as made (a draft writes only the anchor's row)."""
    lm = drafter_models[family]
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    session = open_loop(lm, capacity=256, draft="auto", draft_tokens=3, checkpoint_stride=8).session
    spec, drafter = session.spec, lm.drafter
    names = [stage.attn.name for stage in drafter.stages]
    checked = []

    def catch_up(length, original=spec.catch_up):
        original(length)
        q = torch.tensor([length - 1])
        fresh = drafter.new_state(session.capacity, session.state.spare)
        drafter.commit(fresh, spec.rows_at(q), None, q)
        for name in names:
            ring = spec.state.rings[name]
            slot = (length - 1) % ring.size
            assert torch.equal(ring.data[slot], fresh.rings[name].data[slot]), (family, seed, length, name)
        checked.append(length)

    spec.catch_up = catch_up
    prompt = torch.randint(0, lm.cfg.vocab_size, (19,)).tolist()
    committed, token = list(prompt), int(session.prefill_all(prompt).argmax())
    session.start_sampling(Sampling(), 0)
    for cycles in (12, 5):
        for _ in range(cycles):
            spec.force_accept = rng.choice((0, 1, 2, 3, 3))
            new = session.cycle(token)
            committed += [token, *new[:-1]]
            token = new[-1]
        # back to an earlier position with another token there: its row, and q's key, differ from the cycles'
        back = rng.randrange(len(prompt) + 2, len(committed) - 4)
        committed = committed[:back - 1] + [(committed[back - 1] + 1 + rng.randrange(99)) % lm.cfg.vocab_size]
        token = int(session.prefill_all(committed).argmax())
    assert len(checked) == 17, (family, seed)
    # the block's streams past the anchor's row are the noise token's as made at load: no draft wrote them
    noise = embed.inputs(drafter.block_ids[1:], None, None, drafter.embed, lm.cfg.hc_mult, lm.runtime.dtype)
    assert torch.equal(drafter.block_inputs[1:], noise), (family, seed)
    assert (drafter.block_ids[1:] == lm.cfg.dspark.noise_token_id).all(), (family, seed)
