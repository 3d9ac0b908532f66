"""The token inputs (kernels/embed.py): the kernel writes the history and copies the embedding rows exactly
as the reference does, over a share of the rows, into a given output, in a narrower or wider dtype."""

import random

import pytest
import torch

from kernels import embed


@pytest.mark.parametrize("table_dtype,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_the_kernel_writes_the_history_and_the_embedding_copies_as_the_reference(table_dtype, dtype):
    rng = random.Random()
    vocab, d, copies = rng.randrange(50, 300), rng.choice((24, 130, 1100)), rng.choice((1, 4))
    T = rng.randrange(1, 12)
    table = torch.randn(vocab, d + 3).to(table_dtype)[:, :d]  # rows strided as a view of a wider table
    tokens = torch.randint(0, vocab, (T,))
    positions = torch.randperm(64)[:T]
    lo = rng.randrange(0, T)
    share = rng.choice((slice(None), slice(lo, rng.randrange(lo + 1, T + 1))))
    history = {path: torch.randint(0, vocab, (64,)) for path in ("reference", "fast")}
    history["fast"].copy_(history["reference"])
    want = embed.inputs(tokens, positions, history["reference"], table, copies, dtype, share)
    got = embed.fast_inputs(tokens, positions, history["fast"], table, copies, dtype, share)
    assert got.dtype == dtype and got.shape == want.shape == (len(range(T)[share]), copies, d)
    assert torch.equal(got, want)
    assert torch.equal(history["fast"], history["reference"])
    # into a given output (a drafter's block row), without a history
    out = torch.full((T, copies, d), float("nan"), dtype=dtype)
    assert embed.fast_inputs(tokens, tokens, None, table, copies, dtype, out=out) is out
    assert torch.equal(out, embed.inputs(tokens, tokens, None, table, copies, dtype))


@pytest.mark.parametrize("path", [embed.inputs, embed.fast_inputs])
def test_a_second_tables_rows_of_the_same_tokens_go_into_a_view_of_wider_rows(path):
    """DSpark's anchor: its Markov row (float32, W wider or narrower than D) into the confidence head's
    features, in the launch that embeds it."""
    rng = random.Random()
    vocab, d, w = rng.randrange(50, 300), rng.choice((24, 130)), rng.choice((16, 256))
    T = rng.randrange(1, 4)
    table, table2 = torch.randn(vocab, d).to(torch.bfloat16), torch.randn(vocab, w)
    tokens = torch.randint(0, vocab, (T,))
    features = torch.full((T, d + w), float("nan"))
    out = path(tokens, tokens, None, table, 4, torch.bfloat16, also=(table2, features[:, d:]))
    assert torch.equal(features[:, d:], table2[tokens]), "the second table's rows as they are"
    assert features[:, :d].isnan().all(), "written outside the view"
    assert torch.equal(out, embed.inputs(tokens, tokens, None, table, 4, torch.bfloat16))


def test_bad_arguments_are_refused_naming_the_field():
    table = torch.randn(10, 8)
    with pytest.raises(TypeError, match="tokens.dtype"):
        embed.fast_inputs(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.long), None, table, 1,
                          torch.float32)
    with pytest.raises(ValueError, match="positions.shape"):
        embed.fast_inputs(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                          torch.zeros(8, dtype=torch.long), table, 1, torch.float32)
    with pytest.raises(ValueError, match="out"):
        embed.fast_inputs(torch.zeros(3, dtype=torch.long), None, None, table, 2, torch.float32,
                          out=torch.empty(3, 1, 8))
    with pytest.raises(ValueError, match=r"also\[1\]"):
        embed.fast_inputs(torch.zeros(3, dtype=torch.long), None, None, table, 2, torch.float32,
                          also=(table, torch.empty(3, 8, dtype=torch.float64)))
