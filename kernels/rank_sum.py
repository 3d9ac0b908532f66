"""The sum of several ranks' float32 partials in rank order, ((p0 + p1) + p2) + p3, elementwise: what the
split layers' partial sums add up to on every rank (appliance/parallel/collectives.py gathers them).

Reference (`reference`): the adds as torch operations, world - 1 launches. Kernel (`fast`): one launch, the
same float32 adds in the same order per element (no contraction, no reassociation), so bitwise equal to the
reference, then rounded once where the caller asks (a split linear's output dtype, the indexer's bfloat16
scores kept as float32); each partial given by its own pointer, so a rank's gathered rows [world, n] and
peers' buffers in symmetric memory (one tensor each, on as many devices) are read in place. A consumer of
the sum (the next mHC site, which expands the attention's output; the MoE's combine) takes the partials
itself and adds them where it loads its input (`rank_load`): the same adds, no launch of their own.

Over symmetric memory nothing waits outside the kernels: the kernel that makes a rank's partial writes it
into its buffer's slot (`publish_slot`) and, its last program, stores the rank's count of published calls
into every rank's flag word for it (`rank_publish`): a product's own kernel (kernels/linear.py, the MoE's
down kernel, given a `Publish`) or `publish`, a copy; a consumer given the same (`Partials`) waits inside
its kernel (`rank_arrive`) until every rank's count reaches its own, then reads the peers' slots in place. A rank
waits only on other ranks' publishes, never on a program of its own launch. Two slots suffice: a rank
writes a slot again (call c + 2) only after its consumer of call c + 1 saw every peer publish c + 1, which
each peer does after its consumer of call c finished reading.
"""

from typing import NamedTuple

import torch

from ._triton import (
    INTERPRET,
    bf16_value,
    dependent_launch,
    device_function,
    pdl,
    require,
    require_dtype,
    round_out,
    tl,
    triton,
)

MAX_WORLD = 8  # the partials one launch takes (a box has at most eight GPUs; each count compiles its own)
BLOCK = 4096 if INTERPRET else 1024  # elements per program (the interpreter's cost is per program)
PUBLISH_BLOCK = 1 << 16 if INTERPRET else 1024  # a copy: the interpreter's programs as large as it takes
SLOTS = 2  # a symmetric buffer's slots: call c's partial in slot c % SLOTS (the module docstring says why 2)
_SLOTS_K, _MAX_WORLD_K = tl.constexpr(SLOTS), tl.constexpr(MAX_WORLD)  # ... as the kernels read them


class Publish(NamedTuple):
    """Where a rank's partials are published: this rank's symmetric buffer [SLOTS x capacity] (float32), every
    rank's flags (int64 [world + 1] each, rank order: word r counts rank r's published calls and is written
    only by rank r; word world, a producer's count-in), this rank. A producer writes into it; its consumers
    wait on the same (`Partials`)."""

    buffer: torch.Tensor
    flags: list[torch.Tensor]
    rank: int

    @property
    def capacity(self) -> int:
        """Values a slot holds: call c's partial starts at c % SLOTS x capacity."""
        return self.buffer.numel() // SLOTS

    def check(self, n: int) -> tuple:
        """The kernel arguments of a producer of n values (this rank's flags, every rank's as a tuple, this
        rank, a slot's capacity) and the world, checked."""
        world = len(self.flags)
        require(n <= self.capacity, "publish", n, f"values: must be at most the slot's {self.capacity}")
        require(1 <= world <= MAX_WORLD and 0 <= self.rank < world, "rank", self.rank,
                f"must be one of {world} ranks")
        return (self.flags[self.rank], tuple(self.flags), self.rank, self.capacity), world


class Partials(list):
    """Every rank's partial in rank order (views of their slot 0: the kernel adds the call's slot) and the
    `Publish` they came through, which a consumer's kernel waits on before it reads them."""

    def __init__(self, parts, published: Publish):
        super().__init__(parts)
        self.published = published


def arrival_args(parts) -> tuple:
    """A consumer kernel's (this rank's flags, rank, capacity) and its WAIT constexpr for `parts`: a
    `Partials`' publish, or nothing to wait for (gathered partials, one tensor)."""
    p = getattr(parts, "published", None)
    return ((p.flags[p.rank], p.rank, p.capacity), True) if p is not None else ((parts[0], 0, 0), False)


def plain(parts, what: str) -> None:
    """A reference (torch) consumer's guard: partials published in place need a kernel that waits for them."""
    require(getattr(parts, "published", None) is None, what, "published partials",
            "a torch consumer cannot wait for them inside a kernel (the fast path's kernels take them)")


def reference(parts: list[torch.Tensor], out_dtype: torch.dtype = torch.float32,
              round_to: torch.dtype | None = None) -> torch.Tensor:
    """parts: world float32 tensors of one shape -> parts[0] + parts[1] + ... in that order, rounded to
    `round_to` (None: not rounded; bfloat16: the nearest bfloat16 value), stored as `out_dtype`."""
    plain(parts, "parts")
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    if round_to is not None:
        out = out.to(round_to).float()
    return out.to(out_dtype)


@device_function
def rank_load(parts, offs, mask, WORLD: tl.constexpr):
    """The rank-order float32 sum ((p0 + p1) + p2) + ... of the elements at `offs` of WORLD partials (a tuple
    of pointers; one of any float dtype: its values as float32)."""
    acc = tl.load(parts[0] + offs, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, WORLD):  # unrolled: rank order, one rounding per add
        acc = acc + tl.load(parts[r] + offs, mask=mask, other=0.0)
    return acc


@device_function
def rank_arrive(flags, rank, capacity, WAIT: tl.constexpr, WORLD: tl.constexpr):
    """With WAIT, a consumer's wait for its call's partials (`arrival_args`: flags, rank, capacity): this rank's
    count of published calls c (its own publish of this call is complete: the launch ahead of this one in the
    stream), then every rank's count at least c (an acquire at system scope: the peers' slots are visible
    after it). Returns the offset of call c's slot in every rank's buffer; 0 without WAIT."""
    base = 0
    if WAIT:
        c = tl.load(flags + rank, volatile=True)
        ranks = tl.arange(0, _MAX_WORLD_K)
        live = ranks < WORLD
        seen = tl.atomic_add(flags + ranks, 0, mask=live, sem="acquire", scope="sys")
        while tl.min(tl.where(live, seen, c)) < c:  # every rank's count read together, until all reach c
            seen = tl.atomic_add(flags + ranks, 0, mask=live, sem="acquire", scope="sys")
        base = ((c - 1) % _SLOTS_K) * capacity
    return base


@device_function
def publish_slot(mine, rank, capacity):
    """A producer's count of this rank's published calls c (this call goes to slot c % SLOTS) and the
    offset of that slot in its buffer."""
    c = tl.load(mine + rank, volatile=True)
    return c, (c % _SLOTS_K) * capacity


@device_function
def rank_publish(mine, flag_ptrs, rank, c, programs, WORLD: tl.constexpr):
    """A producer program's last statement: its count-in (one of `programs`); the last program to count in
    sees every program's stores and releases them to every rank with the count c + 1 (system scope)."""
    tl.debug_barrier()  # the program's stores precede its count-in
    if tl.atomic_add(mine + WORLD, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(mine + WORLD, 0)  # ready for the next call (a graph replays this launch)
        for r in tl.static_range(WORLD):
            tl.atomic_xchg(flag_ptrs[r] + rank, c + 1, sem="release", scope="sys")


@triton.jit
def _publish_kernel(src_ptr,     # float32 [n], this rank's partial
                    buffer_ptr,  # float32 [SLOTS x capacity], this rank's symmetric buffer
                    mine, flag_ptrs, rank, capacity,  # Publish.check's
                    n, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    c, base = publish_slot(mine, rank, capacity)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(buffer_ptr + base + offs, tl.load(src_ptr + offs, mask=m), mask=m)
    rank_publish(mine, flag_ptrs, rank, c, tl.num_programs(0), WORLD)


def publish(t: torch.Tensor, to: Publish) -> torch.Tensor:
    """Copy this rank's float32 partial `t` (at most a slot) into the slot of its next call and count the
    call in every rank's flags (its consumers wait on `to`; a producer that writes its output into the slot
    itself, kernels/linear.py `fast`'s `publish`, takes no launch of this): what it wrote, a view of the
    buffer's first slot."""
    require_dtype(t, "t", (torch.float32,))
    args, world = to.check(t.numel())
    n = max(t.numel(), 1)  # one program at least: the count is published for an empty call too
    # the buffer's start, as a view of the values one call writes (the kernel adds the slot's offset)
    written = to.buffer[:n]
    _publish_kernel[(triton.cdiv(n, PUBLISH_BLOCK),)](t.contiguous(), written, *args, t.numel(), WORLD=world,
                                                      BLOCK=PUBLISH_BLOCK, **pdl(to.buffer.device))
    return written[:t.numel()]


@triton.jit
def _kernel(parts,    # a tuple of WORLD pointers, float32 [n] each (their call's slot at `base`)
            out_ptr,  # out [n]: float32, or bfloat16 (OUT_BF16)
            n, flags, rank, capacity,  # the partials' Publish (arrival_args; WAIT)
            WORLD: tl.constexpr, ROUND_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
            WAIT: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    base = rank_arrive(flags, rank, capacity, WAIT, WORLD)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    acc = rank_load(parts, base + offs, m, WORLD)
    if ROUND_BF16:
        acc = bf16_value(acc)
    tl.store(out_ptr + offs, round_out(acc, OUT_BF16), mask=m)


def fast(parts: list[torch.Tensor], out_dtype: torch.dtype = torch.float32,
         round_to: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `reference` (same signature, bitwise the same result): contiguous float32 partials;
    out_dtype float32 or bfloat16, round_to None or bfloat16 (float32: nothing to round); `out`: where to
    store (contiguous, the parts' shape and out_dtype), a new tensor when None; `Partials`: waited for in the
    kernel."""
    world = len(parts)
    require(1 <= world <= MAX_WORLD, "len(parts)", world, f"must be 1..{MAX_WORLD} (ranks)")
    require(out_dtype in (torch.float32, torch.bfloat16), "out_dtype", out_dtype, "must be float32 or bfloat16")
    require(round_to in (None, torch.float32, torch.bfloat16), "round_to", round_to,
            "must be None, float32 or bfloat16")
    shape = parts[0].shape
    for r, p in enumerate(parts):
        require_dtype(p, f"parts[{r}]", (torch.float32,))
        require(p.shape == shape, f"parts[{r}].shape", tuple(p.shape), f"must be {tuple(shape)} (parts[0]'s)")
        require(p.is_contiguous(), f"parts[{r}].is_contiguous()", False, "must be contiguous")
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=parts[0].device)
    require(out.shape == shape and out.dtype == out_dtype and out.is_contiguous(), "out",
            f"{tuple(out.shape)} {out.dtype}", f"must be contiguous {tuple(shape)} {out_dtype}")
    n = out.numel()
    if n:
        wait, waits = arrival_args(parts)
        _kernel[(triton.cdiv(n, BLOCK),)](tuple(parts), out, n, *wait, WORLD=world,
                                          ROUND_BF16=round_to == torch.bfloat16, OUT_BF16=out_dtype == torch.bfloat16,
                                          BLOCK=BLOCK, WAIT=waits, **pdl(out.device))
    return out
