"""Dependent phases inside one launch (kernels/phases.py): the chain of phases against its torch reference, bit
for bit, its counters back at zero after each launch (a captured graph replays it); a program's wait holds
until the phase before it has counted every program in, and lets it go when it has."""

import random
import threading
import time

import pytest
import torch

from kernels import phases
from kernels._triton import counters, tl, triton

from .kernel_check import DEVICE, run, seed


@pytest.mark.parametrize("trial", range(4))
def test_the_chain_of_phases_equals_its_reference_and_leaves_its_counters_at_zero(trial):
    random.seed(seed())  # the shapes drawn from the seed as well as the values
    n_phases, programs = random.randint(1, 6), random.choice((1, 2, 3, 8))
    x = torch.randn(programs * random.choice((1, 4, 32)), device=DEVICE)
    want = phases.reference(x, n_phases, programs)
    for _ in range(2):  # the second launch takes the counters the first left
        got = run(phases.chain, x, n_phases, programs)
        assert torch.equal(got, want)
        assert not counters(x.device, n_phases + 1).any()


@pytest.mark.parametrize("args, field", [((0, 4), "phases"), ((2, 5), "programs"), ((2, 0), "programs"),
                                         ((1, 1), "programs")])
def test_bad_arguments_name_their_field(args, field):
    x = torch.randn(12 if args == (1, 1) else 16)  # one program of 12: not a power-of-two block
    with pytest.raises(ValueError, match=f"^{field}="):
        phases.chain(x, *args)
    with pytest.raises(TypeError, match="^x.dtype="):
        phases.chain(x.double(), 1, 4)


@triton.jit
def _waiter(cnt_ptr, flag_ptr, programs):
    phases.phase_wait(cnt_ptr, 0, programs)
    tl.store(flag_ptr, 1)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="another thread moves the count: the interpreter's memory")
def test_a_wait_holds_until_the_phase_before_has_every_program_in():
    cnt = torch.zeros(2, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    waiting = threading.Thread(target=lambda: _waiter[(1,)](cnt, flag, 3), daemon=True)
    waiting.start()
    for done in (1, 2):
        cnt[1] = done  # some of phase 0's programs in
        time.sleep(0.3)
        assert waiting.is_alive() and flag.item() == 0
    cnt[1] = 3
    waiting.join(timeout=30)
    assert not waiting.is_alive() and flag.item() == 1
