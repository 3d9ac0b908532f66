"""DeepSeek-V4.1 against the official reference implementation's outputs (tests/data/v41-tiny-a), following
the fixture's recommended_checks.

The model is chaotic under the official FP8/FP4 emulation: one flipped rounding (a value within a float32
ulp of an e4m3 tie) changes routing and index selection for later tokens. Our float32 evaluation differs
from the fixture's in the last place of plain products (a different BLAS order), so whole-prompt runs
diverge after the first such tie (position 116 here: an attn_norm output of -0.359375 +- 1 ulp in layer 3).
Which tie flips is a lottery of evaluation order, not a defect: computing only the mHC projection with the
CPU BLAS's float32 sgemm instead of float64 moved the first divergence to position 359 (end-to-end top-1
0.89 -> 0.975); also computing Engram's gate in float32 moved it back to 116. And the BLAS order is not
batch invariant (a row's result depends on how many rows share the product), so drafting could not use it.
The discriminating checks are therefore the segment-forced ones and the short decode; the end-to-end and
long teacher-forced decode checks use the fixture's own soft gates."""

import json

import pytest
import torch

from appliance.measure.selections import engram_ids, index_topk
from appliance.model import deepseek_v41
from appliance.model.engram import EngramHash, build_token_map
from appliance.model.step import begin

from .conftest import FIXTURE


def compare(got, want):
    d = (got - want).abs().amax(-1)
    lp, lw = torch.log_softmax(got, -1), torch.log_softmax(want, -1)
    return {"median_maxabs": d.median().item(), "max_abs": d.max().item(),
            "top1": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "mean_kl": (lw.exp() * (lw - lp)).sum(-1).mean().item()}


def rel(a, b):
    return (a - b).flatten(1).norm(dim=-1) / b.flatten(1).norm(dim=-1)


def test_engram_token_map_and_hash_ids_match_exactly(fixture_model, expected):
    cfg = fixture_model.cfg
    tm = build_token_map(FIXTURE / "tokenizer.json", cfg.engram.compressed_vocab_size)
    assert torch.equal(tm, expected["engram_token_map"])
    h = EngramHash(tm, cfg)
    comp = h.compressed(expected["prompt_ids"])
    ids = h.ids(comp, 0, len(comp)).transpose(0, 1)
    assert torch.equal(ids, expected["engram_hash_ids"])


def test_each_segment_from_the_fixture_cuts_meets_the_float32_gate(fixture_model, expected):
    m = fixture_model.model
    toks = expected["prompt_ids"]
    cuts = expected["cut_layers"].tolist()
    for k, first in enumerate(cuts):
        step = begin(m.new_state(1024), toks, None, "own")
        m.embed_tokens(step)  # the token history the Engram lookup reads (the forward's token inputs write it)
        rows = m.engram_rows(step)
        last = cuts[k + 1] if k + 1 < len(cuts) else m.cfg.n_layers
        X, pre = m.run_layers(expected["cut_h"][k].clone(), expected["cut_pre_mix"][k].clone(), step, first, last,
                              rows)
        if k + 1 < len(cuts):
            r = rel(X, expected["cut_h"][k + 1]).median().item()
            assert r <= 1e-4, f"segment {first}..{last}: median per-token relative error {r:.3g}"
        else:
            c = compare(m.final(X, pre), expected["prefill_logits"])
            assert c["median_maxabs"] <= 1e-3 and c["top1"] >= 0.98, c


def test_end_to_end_prefill_logits_meet_the_fixtures_smoke_gate(fixture_model, expected):
    m = fixture_model.model
    c = compare(m.forward(expected["prompt_ids"], m.new_state(1024)).logits, expected["prefill_logits"])
    print("end-to-end prefill vs the official reference:", json.dumps(c))
    assert c["top1"] >= 0.8 and c["mean_kl"] <= 0.05, c


def test_selecting_by_block_maxima_changes_no_selection_and_no_logit(fixture_model, expected, monkeypatch):
    """A long call over many keys selects its rows inside the blocks with the largest maxima
    (deepseek_v41.blocks_by_maxima); taken wherever it can be here (the tiny model's keys are few), the
    prompt's selections and logits are those of the selection over all rows, bit for bit."""
    m = fixture_model.model
    narrowed = []
    by_maxima = deepseek_v41.blocks_by_maxima

    def counted(*args):
        out = by_maxima(*args)
        narrowed.append(out is not None)
        return out

    runs = []
    for gain in (deepseek_v41.MAXIMA_GAIN, 0):
        monkeypatch.setattr(deepseek_v41, "MAXIMA_GAIN", gain)
        monkeypatch.setattr(deepseek_v41, "blocks_by_maxima", counted)
        with index_topk(m) as kept:
            logits = m.forward(expected["prompt_ids"], m.new_state(1024)).logits
        runs.append((logits, kept))
    assert any(narrowed) and not all(narrowed), narrowed
    (plain, plain_kept), (narrow, narrow_kept) = runs
    assert plain_kept.keys() == narrow_kept.keys()
    for layer, picks in plain_kept.items():
        assert all(torch.equal(a, b) for a, b in zip(picks, narrow_kept[layer], strict=True)), f"layer {layer}"
    assert torch.equal(plain, narrow)


@pytest.mark.parametrize("mode, key", [("reference", "short_decode_logits"), ("own", "ownkeys_short_decode_logits")])
def test_short_decode_one_token_per_call_matches_the_reference(fixture_model, expected, mode, key):
    m = fixture_model.model
    toks = expected["prompt_ids"]
    state = m.new_state(1024)
    rows = [m.forward(toks[:32], state, logits="last", index_keys=mode).logits[0]]
    rows += [m.forward(toks[i:i + 1], state, index_keys=mode).logits[0] for i in range(32, 95)]
    c = compare(torch.stack(rows), expected[key])
    assert c["median_maxabs"] <= 1e-4 and c["top1"] >= 0.98 and c["max_abs"] <= 0.1, c


def test_short_decode_tells_the_two_index_key_publications_apart(fixture_model, expected):
    m = fixture_model.model
    toks = expected["prompt_ids"]
    state = m.new_state(1024)
    m.forward(toks[:32], state, index_keys="own")
    rows = [m.forward(toks[i:i + 1], state, index_keys="own").logits[0] for i in range(32, 95)]
    assert compare(torch.stack(rows), expected["short_decode_logits"][1:])["median_maxabs"] > 0.1


@pytest.mark.parametrize("mode, ids_key, key", [("reference", "greedy_ids", "greedy_step_logits"),
                                                ("own", "ownkeys_greedy_ids", "ownkeys_greedy_step_logits")])
def test_teacher_forced_decode_of_the_greedy_ids_meets_the_fixtures_soft_gate(fixture_model, expected, mode,
                                                                              ids_key, key):
    m = fixture_model.model
    state = m.new_state(1024)
    rows = [m.forward(expected["prompt_ids"], state, logits="last", index_keys=mode).logits[0]]
    g = expected[ids_key]
    rows += [m.forward(g[k:k + 1], state, index_keys=mode).logits[0] for k in range(47)]
    c = compare(torch.stack(rows), expected[key])
    print(f"teacher-forced decode ({mode}):", json.dumps(c))
    assert c["top1"] >= 0.75, c


def test_dumps_match_the_fixture_before_the_first_chaotic_divergence(fixture_model, expected):
    m = fixture_model.model
    with engram_ids(m) as row_ids, index_topk(m) as kept:
        out = m.forward(expected["prompt_ids"], m.new_state(1024))
    assert torch.equal(row_ids[0], expected["engram_hash_ids"])
    for L in (2, 4, 6, 8):  # all selections agree up to position 116 (see the module docstring)
        assert torch.equal(kept[L][0][:116].int(), expected[f"prefill_index_topk_layer{L}"][:116]), L
    r = rel(out.hidden[:116], expected["prefill_main_hidden"][:116]).median().item()
    assert r <= 1e-4


def test_dspark_in_isolation_reproduces_every_draft_block(fixture_model, expected):
    d = fixture_model.drafter
    greedy, key = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 0])  # temperature 0
    for prefix in ("", "ownkeys_"):
        state = d.new_state(1024)
        d.commit(state, expected["prefill_main_hidden"], expected["prompt_ids"], 0)
        recorded = expected["dspark_positions"].tolist()
        for j in range(47):
            q = int(expected["dspark_all_positions"][j])
            anchor = expected[prefix + "dspark_all_input_ids"][j:j + 1]
            draft = d.draft(state, q, anchor, expected[prefix + "decode_main_hidden"][j], 5, greedy, key)
            assert draft.ids.tolist() == expected[prefix + "dspark_all_draft_ids"][j].tolist(), (prefix, j)
            err = (draft.confidence - expected[prefix + "dspark_all_confidence"][j]).abs().max().item()
            assert err <= 1e-4, (prefix, j, err)
            if q in recorded:
                want = expected[prefix + "dspark_logits"][recorded.index(q)]
                assert (draft.logits - want).abs().max().item() <= 1e-3
