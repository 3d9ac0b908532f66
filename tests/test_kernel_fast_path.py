"""End to end: the fast path (every op a Triton kernel; on CPU under the interpreter) generates the same
greedy tokens as the reference path on every tiny checkpoint and on the official fixture, with logits
within the stated tolerance (relative to the largest logit: 2^-20; in practice they are identical, since
every kernel reproduces its reference's roundings). Short on purpose: the interpreter is slow, so a
16-token prefill and 6 greedy steps per model."""

import pytest
import torch

from kernels import _triton

from .conftest import FIXTURE, load
from .kernel_check import assert_close

LOGIT_TOL = 2.0**-20
PREFILL, STEPS = 16, 6


def greedy(model_dir, path):
    lm = load(model_dir, path=path)
    model = lm.model
    state = model.new_state(PREFILL + STEPS + 8)
    prompt = (torch.arange(PREFILL) * 7 + 3) % lm.cfg.vocab_size
    logits = [model.forward(prompt, state, logits="all").logits]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(model.forward(torch.tensor([tokens[-1]]), state, logits="last").logits)
    tokens.append(int(logits[-1][-1].argmax()))
    return tokens, torch.cat(logits)


@pytest.mark.skipif(not _triton.INTERPRET, reason="runs the tiny models on the CPU, which needs the Triton "
                    "interpreter (on a CUDA machine the kernels run on the GPU; the model loads on the CPU)")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: exp overflow to inf
@pytest.mark.parametrize("name", ["deepseek_v41", "deepseek_v4", "deepseek_v4_0731", "fixture"])
def test_the_fast_path_generates_the_reference_greedy_tokens(name, tiny_dirs):
    model_dir = FIXTURE if name == "fixture" else tiny_dirs[name]
    want_tokens, want_logits = greedy(model_dir, "reference")
    got_tokens, got_logits = greedy(model_dir, "fast")
    assert got_tokens == want_tokens, f"{name}: fast {got_tokens} != reference {want_tokens}"
    assert_close("logits", want_logits, got_logits, LOGIT_TOL, context=name)
