"""The op registry: the model's only way to reach its math. `resolve("reference")` gives the plain torch
definitions; `resolve("fast")` gives the Triton kernels where they exist. The two paths run the same
model code and differ only here."""

from dataclasses import dataclass, fields
from typing import Callable

from . import attention, indexer, linear, mhc, moe, rmsnorm, rope


@dataclass(frozen=True)
class Ops:
    path: str
    linear: Callable
    rmsnorm: Callable
    rope: Callable
    hc_coeffs: Callable
    hc_head_pre: Callable
    hc_collapse: Callable
    hc_expand: Callable
    attention: Callable
    index_scores: Callable
    index_select: Callable
    candidate_mask: Callable
    moe_route: Callable
    moe: Callable

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "path"]


REFERENCE = Ops(
    path="reference",
    linear=linear.reference,
    rmsnorm=rmsnorm.reference,
    rope=rope.reference,
    hc_coeffs=mhc.coeffs,
    hc_head_pre=mhc.head_pre,
    hc_collapse=mhc.collapse,
    hc_expand=mhc.expand,
    attention=attention.reference,
    index_scores=indexer.scores,
    index_select=indexer.select,
    candidate_mask=indexer.candidate_mask,
    moe_route=moe.route,
    moe=moe.reference,
)


def resolve(path: str) -> Ops:
    if path == "reference":
        return REFERENCE
    raise ValueError(f"op path {path!r}: must be 'reference' or 'fast'")
