"""Dependent phases inside one launch: the programs of a later phase wait, in the kernel, for every program
of the phase before it (what a launch boundary gives), so dependent steps share a launch: a decode step's
router, its experts' gate and up, and their down take one (kernels/moe.py `_step_kernel`) where they took
three. A phase is another kernel's launch held (`Phase`: its grid, arguments and constexprs), its program
a device function that takes its program ids as arguments.

Every wait ends: a program takes its place in the launch from a ticket counter as its first act after the
launch's own dependency wait, not from its program id. The hardware may start programs in any order, but a
program holding ticket t knows that tickets 0..t-1 went to programs already running. Phases are consecutive
ranges of tickets; a program waits only on the phase before its own, whose programs are running or done and
wait only on the phase before theirs. Under the interpreter programs run one by one in id order, each
taking the next ticket: a wait finds the phase before complete.

Counters (int32, kernels._triton.counters: zero between launches, as a captured graph replays them): [0] the
ticket, [1 + j] the programs of phase j done. The last phase's last program resets them: by then every
program has taken its ticket (the last phase's are the highest) and every phase is done.

`chain` (and `reference` beside it) is the measure of that wait (appliance/measure/bench.py
`measure_phase_wait`: one launch of several phases against a launch each, dependent launches): each phase's
program p writes its block from program p + 1's block of the phase before, plus one.
"""

import contextlib
import contextvars
import inspect
from typing import NamedTuple

import torch

from ._triton import counters, dependent_launch, device_function, pdl, require, require_dtype, tl, triton


class Phase(NamedTuple):
    """A kernel's launch held to run as a phase of another launch: its grid (programs, row blocks or tiles),
    its arguments and its constexprs, as its own kernel takes them."""

    grid: tuple[int, int]
    args: tuple
    constexprs: dict


def in_order(program, constexprs: dict) -> tuple:
    """A Phase's constexprs as the tuple a launch of phases passes to the phase's `program` (a device function
    taking them last, by name): in the program's parameter order, every one of them taken."""
    names = [n for n in inspect.signature(getattr(program, "fn", program)).parameters if n in constexprs]
    require(len(names) == len(constexprs), "constexprs", sorted(set(constexprs) - set(names)),
            f"must all be parameters of {getattr(program, '__name__', program)}")
    return tuple(constexprs[n] for n in names)


# Whether the launches that can join as phases of one launch do (`separate_phases`): a launch each inside
# `launched_apart()` (the tests' and the device check's comparison)
_APART = contextvars.ContextVar("launched_apart", default=False)


def separate_phases() -> bool:
    """Whether the launches that could be phases of one launch are made one by one (`launched_apart`)."""
    return _APART.get()


@contextlib.contextmanager
def launched_apart():
    """Inside: the launches that would join as phases of one launch are made one by one."""
    token = _APART.set(True)
    try:
        yield
    finally:
        _APART.reset(token)


@device_function
def phase_ticket(cnt_ptr):
    """This program's place in the launch (its first act after `dependent_launch`)."""
    return tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")


@device_function
def phase_wait(cnt_ptr, phase, programs):
    """Wait until `programs` programs of `phase` are done (`phase_done`): their stores are visible after it."""
    while tl.atomic_add(cnt_ptr + 1 + phase, 0, sem="acquire", scope="gpu") < programs:
        pass
    tl.debug_barrier()  # one thread waited: the others load after it


@device_function
def phase_done(cnt_ptr, phase, programs, last_phase):
    """A program's last act in its phase: its stores released to the phase after it. The last phase's last
    program resets the counters of phases 0..last_phase and the ticket, for the next launch."""
    tl.debug_barrier()  # every thread's stores precede the count
    if tl.atomic_add(cnt_ptr + 1 + phase, 1, sem="acq_rel", scope="gpu") == programs - 1:
        if phase == last_phase:
            for j in range(last_phase + 1):
                tl.atomic_xchg(cnt_ptr + 1 + j, 0)
            tl.atomic_xchg(cnt_ptr, 0)


def reference(x: torch.Tensor, phases: int, programs: int) -> torch.Tensor:
    """x [n] (n a multiple of `programs`, in blocks of n / programs) -> after each of `phases` steps, block p
    is block p + 1 (mod programs) of the step before plus one."""
    v = x.reshape(programs, -1)
    for _ in range(phases):
        v = torch.roll(v, -1, dims=0) + 1.0
    return v.reshape(x.shape)


@triton.jit
def _chain_kernel(x_ptr,    # float32 [P BLOCK]
                  w_ptr,    # float32 [PHASES, P BLOCK]: each phase's output; the last is the result
                  cnt_ptr,  # int32 counters (module docstring)
                  P, PHASES, BLOCK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    t = phase_ticket(cnt_ptr)
    phase = t // P
    p = t % P
    src = x_ptr
    if phase > 0:
        phase_wait(cnt_ptr, phase - 1, P)
        src = w_ptr + (phase - 1) * P * BLOCK
    offs = tl.arange(0, BLOCK)
    v = tl.load(src + ((p + 1) % P) * BLOCK + offs)
    tl.store(w_ptr + (phase * P + p) * BLOCK + offs, v + 1.0)
    phase_done(cnt_ptr, phase, P, PHASES - 1)


def chain(x: torch.Tensor, phases: int, programs: int) -> torch.Tensor:
    """The kernel for `reference`: one launch of `phases` phases of `programs` programs each."""
    require_dtype(x, "x", (torch.float32,))
    require(phases >= 1, "phases", phases, "must be at least 1")
    require(programs >= 1 and x.numel() % programs == 0, "programs", programs,
            f"must be positive and divide x's {x.numel()} elements")
    block = x.numel() // programs
    require(block & (block - 1) == 0, "programs", programs, f"must leave a power-of-two block (here {block})")
    x = x.contiguous()
    w = torch.empty((phases, x.numel()), dtype=torch.float32, device=x.device)
    _chain_kernel[(phases * programs,)](x, w, counters(x.device, phases + 1), programs, phases, BLOCK=block,
                                        **pdl(x.device))
    return w[-1].view(x.shape)
