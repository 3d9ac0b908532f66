"""The sum of several ranks' float32 partials in rank order, ((p0 + p1) + p2) + p3, elementwise: what the
split layers' partial sums add up to on every rank (appliance/parallel/collectives.py gathers them).

Reference (`reference`): the adds as torch operations, world - 1 launches. Kernel (`fast`): one launch, the
same float32 adds in the same order per element (no contraction, no reassociation), so bitwise equal to the
reference, then rounded once where the caller asks (a split linear's output dtype, the indexer's bfloat16
scores kept as float32); each partial given by its own pointer, so a rank's gathered rows [world, n] and
peers' buffers in symmetric memory (one tensor each, on as many devices) are read in place. A consumer of
the sum (the mHC expand of the attention's output, the MoE's combine) takes the partials itself and adds
them where it loads its input (`rank_load`): the same adds, no launch of their own.
"""

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


def reference(parts: list[torch.Tensor], out_dtype: torch.dtype = torch.float32,
              round_to: torch.dtype | None = None) -> torch.Tensor:
    """parts: world float32 tensors of one shape -> parts[0] + parts[1] + ... in that order, rounded to
    `round_to` (None: not rounded; bfloat16: the nearest bfloat16 value), stored as `out_dtype`."""
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


@triton.jit
def _kernel(parts,    # a tuple of WORLD pointers, float32 [n] each
            out_ptr,  # out [n]: float32, or bfloat16 (OUT_BF16)
            n, WORLD: tl.constexpr, ROUND_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
            PDL: tl.constexpr):
    dependent_launch(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    acc = rank_load(parts, offs, m, WORLD)
    if ROUND_BF16:
        acc = bf16_value(acc)
    tl.store(out_ptr + offs, round_out(acc, OUT_BF16), mask=m)


def fast(parts: list[torch.Tensor], out_dtype: torch.dtype = torch.float32,
         round_to: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel for `reference` (same signature, bitwise the same result): contiguous float32 partials;
    out_dtype float32 or bfloat16, round_to None or bfloat16 (float32: nothing to round); `out`: where to
    store (contiguous, the parts' shape and out_dtype), a new tensor when None."""
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
        _kernel[(triton.cdiv(n, BLOCK),)](tuple(parts), out, n, WORLD=world, ROUND_BF16=round_to == torch.bfloat16,
                                          OUT_BF16=out_dtype == torch.bfloat16, BLOCK=BLOCK, **pdl(out.device))
    return out
