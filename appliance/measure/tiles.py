"""How a counted launch's weight products run (count.py's wrappers declare it on each launch): their path
(in the checkpoint's formats, or from registers), whether they can run as a long call's (a prefill chunk:
kernels/_triton.py LONG_ROWS) and what staging their rows then moves, and the rows a selected expert's
products compute, its pairs padded to whole tiles."""

import torch

from kernels._triton import in_long_calls
from kernels.linear import in_native_formats, native_split


def expected_tile_rows(n_experts: int, top_k: int, rows: int, tile: int) -> float:
    """The rows a selected expert's products compute under uniform routing, in expectation: its pairs (each
    row picks it with probability top_k / n_experts: binomial, given at least one) padded to whole tiles of
    `tile`. Not the mean share padded: at 8192 rows V4.1's experts average 128 pairs, and half of them take
    a second tile of 128."""
    x = torch.arange(1, rows + 1, dtype=torch.float64)
    p = torch.tensor(min(top_k / n_experts, 1.0), dtype=torch.float64)
    pmf = torch.distributions.Binomial(rows, probs=p).log_prob(x).exp()
    return float((pmf * torch.ceil(x / tile) * tile).sum() / pmf.sum())


def tile_rows(indices: torch.Tensor, held: list[bool], tile: int) -> float:
    """The rows the held selected experts' products compute, each its pairs in `indices` padded to whole
    tiles of `tile`, per selected held expert (a measured call's `expected_tile_rows`)."""
    counts = torch.bincount(indices.flatten().cpu(), minlength=len(held))[torch.tensor(held)]
    counts = counts[counts > 0]
    return float((torch.ceil(counts / tile) * tile).sum() / max(len(counts), 1))


def rows_staging(x: torch.Tensor) -> int:
    """Bytes a staging of x [..., K]'s rows moves: the rows read, a code byte an element written."""
    return x.numel() * (x.element_size() + 1)


def one_product_kind(x, weight, act_block, *rest, **kw) -> tuple[str, bool, int]:
    """A product's launch (linear): (path, can run long, its staging's bytes): in the checkpoint's formats,
    its rows staged; from registers where it is plain (no rows quantized in its loop) on bfloat16 values."""
    if in_native_formats(weight, act_block):
        return "native", True, rows_staging(x)
    return "registers", weight.bf16_exact and not act_block, 0


def expand_kind(x, weight, act_block, *rest, **kw) -> tuple[str, bool, int]:
    """A product with the mHC expand as its epilogue (linear_expand): from registers it keeps short programs
    (the epilogue beside 128 rows spills)."""
    path, long, staged = one_product_kind(x, weight, act_block)
    return path, long and path == "native", staged


def products_kind(x, products, *rest, **kw) -> list[tuple[str, bool, int, list[int]]]:
    """The launches of several products (linear_multi) that the count sees weights in (FP8/FP4; one of dense
    weights only, it does not), each (path, can run long, its staging's bytes, the products it computes): one,
    or in a long call two where products in the checkpoint's formats are beside plain ones
    (kernels/linear.py `native_split`), those first."""
    split = native_split(products)
    parts = [[i for i, n in enumerate(split) if n is part] for part in (True, False)] if split else [
        list(range(len(products)))]
    return [(*_launch_kind(x, [products[i] for i in ix]), ix) for ix in parts
            if any(products[i].weight.format in ("fp8", "fp4") for i in ix)]


def query_kind(x, products, *rest, **kw) -> list[tuple[str, bool, int, list[int] | None]]:
    """`products_kind` of the query products (kernels/query_inputs.py), whose call returns (q, k, qi, w): one
    launch of the products and the row work, which writes all four, or in a long call the products' own
    launches, each writing its queries (q, qi)."""
    kinds = products_kind(x, products)
    if not in_long_calls():
        return [(*kind[:3], None) for kind in kinds]
    return [(*kind, [(0, 2)[i] for i in ix]) for *kind, ix in kinds]


def _launch_kind(x, products) -> tuple[str, bool, int]:
    """One launch of products: in the checkpoint's formats where every product is (long where their rows are
    staged alike: one format and activation block); else from registers (long where every product is plain on
    bfloat16 values)."""
    if all(in_native_formats(p.weight, p.act_block) for p in products):
        alike = len({(p.weight.format, p.act_block) for p in products}) == 1
        return "native", alike, rows_staging(x) if alike else 0
    return "registers", all(p.weight.bf16_exact and not p.act_block for p in products), 0


def engram_kind(X, codes, scales, wkv, act_block, *rest, **kw) -> tuple[str, bool, int]:
    """The Engram layer's product: in the checkpoint's formats, its looked-up rows' codes and bytes read and
    their codes written; from registers it keeps short programs."""
    if in_native_formats(wkv, act_block):
        return "native", True, 2 * codes.numel() + scales.numel()
    return "registers", False, 0
