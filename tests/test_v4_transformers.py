"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (`--numerics plain`, float32): teacher-forced
logits and 64 greedy tokens, from transformers' save_pretrained output and from the official spelling.

Exact top-k ties: an index score is exactly 0 when every head's dot product is negative (the ReLU), and
zeros tie. We break exact ties towards the lower row index (so a prefill, a verify block and a single step
select the same rows); transformers' torch.topk breaks them arbitrarily. The configurations use 16 index
heads, which makes an all-negative row (probability 2^-16) and so a tie at the top-k boundary practically
impossible; router ties need two equal float32 scores. A tie that did occur would fail the test as a token
mismatch at that step, not be hidden."""

import random

import pytest
import torch

from appliance.api import Request

from .conftest import load, open_loop
from .hf_models import CONFIGS, build, save_both


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_case(request, tmp_path_factory):
    seed = random.randrange(1 << 30)
    model = build(request.param, seed)
    hf_dir, off_dir = save_both(model, tmp_path_factory.mktemp(request.param))
    return request.param, seed, model, hf_dir, off_dir


def test_teacher_forced_logits_match_transformers_from_both_spellings(hf_case):
    name, seed, model, hf_dir, off_dir = hf_case
    ids = torch.randint(0, model.config.vocab_size, (77,))
    with torch.no_grad():
        want = model(ids.unsqueeze(0), use_cache=False).logits[0]
    for d in (hf_dir, off_dir):
        lm = load(d, numerics="plain")
        got = lm.model.forward(ids, lm.model.new_state(128)).logits
        err = (got - want).abs().max().item()
        assert err <= 1e-4, f"{name} (seed {seed}) from {d.name}: max |delta| {err:.3g}"


def test_greedy_generation_matches_transformers_for_64_tokens(hf_case):
    name, seed, model, hf_dir, off_dir = hf_case
    prompt = torch.randint(0, model.config.vocab_size, (19,))
    # EOS is an ordinary token here (ignore_eos); transformers' min_new_tokens would suppress it instead.
    # use_cache=False: transformers' cached decode is not batch invariant (fp32 products of different
    # shapes), and near-ties at its indexer's top-k flip between its own cached and uncached runs.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(prompt.unsqueeze(0), max_new_tokens=64, do_sample=False, use_cache=False)[0, 19:]
    lm = load(off_dir, numerics="plain")
    got = []
    for event in open_loop(lm, capacity=256).run(Request(input_ids=prompt.tolist(), max_tokens=64, ignore_eos=True)):
        got += getattr(event, "ids", [])
    assert got == want.tolist(), f"{name} (seed {seed})"
