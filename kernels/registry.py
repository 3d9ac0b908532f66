"""The op registry: the model's only way to reach its math. `resolve("reference")` gives the plain torch
definitions; `resolve("fast")` gives the Triton kernels (every op has one; `Ops.describe()` says which
function serves each op). The two paths run the same model code and differ only here.

Without a CUDA device "fast" runs the kernels under Triton's interpreter (kernels/_triton.py sets
TRITON_INTERPRET=1 before Triton is first imported): correct and very slow, for tests. If Triton cannot
run here at all, resolve("fast") raises with the reason; it never falls back to the reference ops.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

from . import (
    _triton,
    attention,
    attn_inputs,
    compress,
    embed,
    engram,
    indexer,
    linear,
    mhc,
    moe,
    query_inputs,
    ring_rows,
    rmsnorm,
    rope,
    sampling,
)
from ._triton import long_calls  # noqa: F401  (the prefill's: a chunk's products in programs of LONG_ROWS rows)


@dataclass(frozen=True)
class Ops:
    path: str
    token_inputs: Callable
    put_rows: Callable
    linear: Callable
    linear_multi: Callable
    linear_expand: Callable
    rmsnorm: Callable
    rope: Callable
    hc_coeffs: Callable
    hc_head_pre: Callable
    hc_collapse: Callable
    hc_expand_pre: Callable
    hc_pre: Callable
    attention: Callable
    query_inputs: Callable
    window_keys: Callable
    attend: Callable
    compress: Callable
    index_scores: Callable
    index_select: Callable
    ffn: Callable
    engram: Callable
    engram_lookup: Callable
    sample: Callable
    sample_sum: Callable
    accept: Callable

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "path"]

    def kernels(self) -> list[str]:
        """The ops served by a Triton kernel (the rest are torch references)."""
        return [n for n in self.names() if getattr(self, n) in _KERNELS]

    def describe(self) -> str:
        """One line per op: whether a kernel or the torch reference serves it, and which function."""
        lines = [f"op path {self.path!r}:"]
        for n in self.names():
            f = getattr(self, n)
            kind = "kernel" if f in _KERNELS else "reference"
            lines.append(f"  {n:<15} {kind:<9} {f.__module__}.{f.__qualname__}")
        return "\n".join(lines)


REFERENCE = Ops(
    path="reference",
    token_inputs=embed.inputs,
    put_rows=ring_rows.put,
    linear=linear.reference,
    linear_multi=linear.reference_multi,
    linear_expand=mhc.product_expand,
    rmsnorm=rmsnorm.reference,
    rope=rope.reference,
    hc_coeffs=mhc.coeffs,
    hc_head_pre=mhc.head_pre,
    hc_collapse=mhc.collapse,
    hc_expand_pre=mhc.expand_pre,
    hc_pre=mhc.pre,
    attention=attention.reference,
    query_inputs=query_inputs.reference,
    window_keys=attn_inputs.window_keys,
    attend=attention.attend_reference,
    compress=compress.reference,
    index_scores=indexer.scores,
    index_select=indexer.select,
    ffn=moe.reference_ffn,
    engram=engram.layer_reference,
    engram_lookup=engram.lookup_reference,
    sample=sampling.sample,
    sample_sum=sampling.sample_sum,
    accept=sampling.accept,
)

FAST = Ops(
    path="fast",
    token_inputs=embed.fast_inputs,
    put_rows=ring_rows.fast_put,
    linear=linear.fast,
    linear_multi=linear.fast_multi,
    linear_expand=mhc.fast_product_expand,
    rmsnorm=rmsnorm.fast,
    rope=rope.fast,
    hc_coeffs=mhc.fast_coeffs,
    hc_head_pre=mhc.fast_head_pre,
    hc_collapse=mhc.fast_collapse,
    hc_expand_pre=mhc.fast_expand_pre,
    hc_pre=mhc.fast_pre,
    attention=attention.fast,
    query_inputs=query_inputs.fast,
    window_keys=attn_inputs.fast_window_keys,
    attend=attention.fast_attend,
    compress=compress.fast,
    index_scores=indexer.fast_scores,
    index_select=indexer.fast_select,
    ffn=moe.fast_ffn,
    engram=engram.fast_layer,
    engram_lookup=engram.fast_lookup,
    sample=sampling.fast_sample,
    sample_sum=sampling.fast_sample_sum,
    accept=sampling.fast_accept,
)

_KERNELS = frozenset(getattr(FAST, n) for n in FAST.names() if getattr(FAST, n) is not getattr(REFERENCE, n))


def resolve(path: str) -> Ops:
    if path == "reference":
        return REFERENCE
    if path == "fast":
        reason = _triton.ready()
        if reason is not None:
            raise RuntimeError(f"op path 'fast': {reason}")
        return FAST
    raise ValueError(f"op path {path!r}: must be 'reference' or 'fast'")
