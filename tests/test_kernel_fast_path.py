"""End to end on the fast path (every op a Triton kernel; on CPU under the interpreter):

- Tolerance to the reference path, teacher-forced, up to the first row where the paths' discrete choices
  differ (an index's top-k selection, a token's experts: a near tie the last bits break the other way makes
  the two models compute different things from there on), for every tiny model and the official fixture.
  With `--numerics plain` the two paths compute the same rounding points, and the logits agree within
  PLAIN_TOL (a float32 sum against a float64 one: ~2^-22 relative per sum, ~1e-6 of the row's largest
  |logit| measured). With `--numerics official` a value near a rounding boundary of the official
  quantization (an FP8 activation code, an FP4 KV or index code) can land on the other side in one path and
  move by a whole code step, 2^-3 of itself for e4m3's three mantissa bits; in 64- and 128-wide tiny models,
  where a few channels carry a large share of a logit, such flips moved rows by up to 0.126 of their
  largest |logit| (1,568 rows of 81 random prompts on V4.1 and V4; one flip moved one logit by 0.77
  in a row whose largest is 6.2), a fifth of the prompts having one. A flip's effect on the logits is not
  bounded by one code step of the value that flips, only measured: OFFICIAL_TOL is two e4m3 code steps,
  2^-2. In both, the greedy token is the reference's wherever its top-2 margin exceeds twice the tolerance
  (each of the two logits can move by it).
- The DSpark drafter on the fast path (its V4.1 stages on the backbone's fused products and row work):
  its draft logits within PLAIN_TOL of the reference drafter's (oracle-checked against the official
  reference in tests/test_v41_fixture.py), the same drafts where the margins are clear.
- Batch invariance of the whole forward: a verify block of M rows (M = 1, 6 and one of 2..5 drawn) equals M
  single steps bit for bit (logits, DSpark inputs, final streams and every state buffer).
- Whole cycles (tests/test_graph_replay.py, beside the capture stand-in): greedy decoding with each family's
  drafter equals greedy decoding without, token for token.

The interpreter takes seconds per forward, so prompts and generations are short here (sized to keep these
tests within a few minutes); tests/test_speculative.py runs the long versions on the reference path
(128 tokens, k drawn from 1..5) and the kernel tests check every kernel's rows 1..6 bit for bit."""

import random

import pytest
import torch

from appliance.measure.selections import index_topk, routed_experts
from kernels import _triton

from .conftest import FIXTURE, load, use_native_products
from .kernel_check import bits

pytestmark = [
    pytest.mark.skipif(not _triton.INTERPRET, reason="runs the tiny models on the CPU, which needs the Triton "
                       "interpreter (on a CUDA machine the kernels run on the GPU; the model loads on the CPU)"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy under the interpreter: exp overflow to inf
]

PLAIN_TOL = 2.0**-16    # relative to the row's largest |logit|: the float32 kernels against the float64 reference
OFFICIAL_TOL = 2.0**-2  # two e4m3 code steps: flips of the official quantization (README "Numerics")
PROMPT = 20          # teacher-forced tokens: past the 16-token window, several compressed rows and top-k picks
PROMPTS = 3          # fresh prompts a tolerance test may take to compare MIN_ROWS rows
MIN_ROWS = 4         # rows before the paths' first differing choice that one prompt must reach


def _logits_and_choices(lm, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One teacher-forced forward's logits and its discrete choices per row: each index's top-k selection and
    each layer's experts (one MoE call a layer, in layer order)."""
    with index_topk(lm.model) as kept, routed_experts(lm.model) as experts:
        logits = lm.model.forward(tokens, lm.model.new_state(PROMPT), logits="all").logits
    picks = {f"index_topk.{L}": rows[0] for L, rows in kept.items()}
    picks.update({f"experts.{L}": e.sort(-1).values for L, e in enumerate(experts)})
    return logits, picks


@pytest.mark.parametrize("numerics, tol", [("plain", PLAIN_TOL), ("official", OFFICIAL_TOL)])
@pytest.mark.parametrize("name", ["deepseek_v41", "deepseek_v4", "deepseek_v4_0731", "fixture"])
def test_teacher_forced_logits_on_the_fast_path_are_within_the_stated_tolerance(name, numerics, tol, tiny_dirs):
    """Every prompt's rows before its first differing choice are checked; a prompt whose choices part
    within MIN_ROWS rows (a near tie early on: about one prompt in twenty on the V4 models) is followed by a
    fresh one, so that at least one prompt compares MIN_ROWS rows (the test never passes on nothing)."""
    model_dir = FIXTURE if name == "fixture" else tiny_dirs[name]
    models = {path: load(model_dir, path=path, numerics=numerics) for path in ("reference", "fast")}
    compared = []
    for _ in range(PROMPTS):
        seed = random.randrange(1 << 30)
        ctx = f"{name} --numerics {numerics} (seed {seed})"
        want, got = _teacher_forced_until_the_choices_part(models, seed)
        compared.append(want.shape[0])
        err = (got - want).abs().amax(-1) / want.abs().amax(-1)
        print(f"{ctx}: worst |delta logit| / row max {err.max().item():.3g} (tolerance {tol:.3g}) over "
              f"{want.shape[0]} rows")
        assert (err <= tol).all(), f"{ctx}: rows over the tolerance: {(err > tol).nonzero().flatten().tolist()}"
        top2 = want.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tol * want.abs().amax(-1)
        same = want.argmax(-1) == got.argmax(-1)
        assert (same | ~clear).all(), f"{ctx}: greedy token differs at {(~same & clear).nonzero().tolist()}"
        if want.shape[0] >= MIN_ROWS:
            return
    pytest.fail(f"{name} --numerics {numerics}: the paths' discrete choices parted within {MIN_ROWS} rows on "
                f"{PROMPTS} fresh prompts (rows compared: {compared})")


@pytest.mark.parametrize("name", ["deepseek_v41", "fixture"])
def test_teacher_forced_logits_with_products_in_the_checkpoints_formats_are_within_the_stated_tolerance(
        name, tiny_dirs, native):
    test_teacher_forced_logits_on_the_fast_path_are_within_the_stated_tolerance(name, "official", OFFICIAL_TOL,
                                                                                 tiny_dirs)
    assert native, "no product multiplied in the checkpoint's formats"


def _teacher_forced_until_the_choices_part(models: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's and the fast path's teacher-forced logits of one random prompt, for the rows before
    the first row where the two paths' discrete choices differ."""
    out, picks = {}, {}
    for path, lm in models.items():
        tokens = torch.randint(0, lm.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(seed))
        out[path], picks[path] = _logits_and_choices(lm, tokens)
    same = torch.ones(PROMPT, dtype=torch.bool)
    for k, v in picks["reference"].items():
        same &= (v == picks["fast"][k]).flatten(1).all(-1)
    rows = int(same.long().cumprod(0).sum())
    return out["reference"][:rows], out["fast"][:rows]


def test_the_dspark_drafter_on_the_fast_path_gives_the_reference_drafts_within_the_stated_tolerance(tiny_dirs):
    seed = random.randrange(1 << 30)
    prompt = torch.randint(0, 512, (PROMPT,), generator=torch.Generator().manual_seed(seed))
    drafts = {}
    for path in ("reference", "fast"):
        lm = load(tiny_dirs["deepseek_v41"], path=path, numerics="plain", draft="auto")
        out = lm.model.forward(prompt, lm.model.new_state(64), logits="last")
        dstate = lm.drafter.new_state(64)
        lm.drafter.commit(dstate, out.hidden[:-1], prompt[1:], 0)  # the ring rows of positions 0 .. P-2
        greedy, key = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([seed, 0])
        drafts[path] = lm.drafter.draft(dstate, PROMPT - 1, out.logits.argmax(-1), out.hidden[-1], 4, greedy, key)
    want, got = drafts["reference"], drafts["fast"]
    scale = want.logits.abs().amax(-1)
    top2 = want.logits.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1] > 2 * PLAIN_TOL * scale).cumprod(0).bool()  # a chain: up to the first tie
    same_input = torch.cat((torch.ones(1, dtype=torch.bool), clear[:-1]))  # draft i reads draft i - 1
    err = (got.logits - want.logits).abs().amax(-1) / scale
    assert (err[same_input] <= PLAIN_TOL).all(), f"(seed {seed}) draft rows over {PLAIN_TOL:.3g}: {err.tolist()}"
    assert torch.equal(got.ids[clear], want.ids[clear]), f"(seed {seed}): {got.ids.tolist()} != {want.ids.tolist()}"
    conf = (got.confidence - want.confidence).abs()[same_input]
    assert (conf <= PLAIN_TOL * want.confidence.abs()[same_input].clamp(min=1)).all(), f"(seed {seed})"


@pytest.mark.slow
@pytest.mark.parametrize("products", ["bfloat16", "block-scaled", "e4m3"])
def test_on_the_fast_path_a_verify_block_of_m_rows_equals_m_single_steps_bitwise(tiny_dirs, products, monkeypatch):
    """M = 1, 6 and one of 2..5 drawn each run, from one prefilled state: six single steps (outputs and state
    kept after each), then for each M the block of M rows from the same start (the state rewound between
    blocks); with the weight products on bfloat16 values (no native products), on the block-scaled MMA
    (sm_100 and later) and on the e4m3 MMA (sm_89/90). Each kernel's rows 1..6: the kernel tests."""
    made = use_native_products(monkeypatch, products) if products != "bfloat16" else None
    lm = load(tiny_dirs["deepseek_v41"], path="fast")
    m, prefix = lm.model, 20
    seed = random.randrange(1 << 30)
    tokens = torch.randint(0, lm.cfg.vocab_size, (prefix + 6,), generator=torch.Generator().manual_seed(seed))
    state = m.new_state(64)
    m.forward(tokens[:prefix], state)
    singles, states = [], []
    for i in range(prefix, prefix + 6):
        singles.append(m.forward(tokens[i:i + 1], state, keep_streams=True))
        states.append({k: v.clone() for k, v in state.buffers().items()})
    state.rewind(prefix)
    for rows in (1, random.Random(seed).randint(2, 5), 6):
        block = m.forward(tokens[prefix:prefix + rows], state, keep_streams=True)
        ctx = f"(seed {seed}, M={rows})"
        for what in ("logits", "hidden", "streams"):
            want = torch.cat([getattr(s, what) for s in singles[:rows]])
            assert torch.equal(bits(getattr(block, what)), bits(want)), f"{what} {ctx}"
        for name, t in state.buffers().items():
            assert torch.equal(bits(t), bits(states[rows - 1][name])), f"state {name} {ctx}"
        state.rewind(prefix)
    assert made is None or made, f"no product multiplied as {products} does"
