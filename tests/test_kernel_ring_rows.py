"""Rows into a ring's slots (kernels/ring_rows.py): the kernel writes the rows the reference writes, converted
to the ring's dtype, and nothing else."""

import random

import pytest
import torch

from kernels import ring_rows


@pytest.mark.parametrize("dtype,values_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16)])
def test_the_kernel_writes_the_rows_at_their_slots_as_the_reference(dtype, values_dtype):
    rng = random.Random()
    size, width, n = rng.randrange(8, 40), rng.choice((3, 130, 5000)), rng.randrange(1, 7)
    start = rng.randrange(0, 100)
    slots = torch.arange(start, start + n) % size  # consecutive positions, wrapping as a ring's do
    values = (torch.randn(n, width + 2) * 3).to(values_dtype)[:, :width]  # rows strided as a view's
    ring = torch.randn(size, width).to(dtype)
    want = ring_rows.put(ring.clone(), slots, values)
    got = ring.clone()
    assert ring_rows.fast_put(got, slots, values) is got
    assert torch.equal(got, want), f"size {size} width {width} rows {n} from slot {start % size}"
    kept = torch.ones(size, dtype=torch.bool)
    kept[slots] = False
    assert torch.equal(got[kept], ring[kept]), "a slot not named was written"


def test_bad_arguments_are_refused_naming_the_field():
    ring = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="values.shape"):
        ring_rows.fast_put(ring, torch.arange(2), torch.zeros(3, 4))
    with pytest.raises(TypeError, match="slots.dtype"):
        ring_rows.fast_put(ring, torch.arange(2, dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="data.dtype"):
        ring_rows.fast_put(ring.double(), torch.arange(2), torch.zeros(2, 4))
