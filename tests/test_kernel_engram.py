"""The Engram gather kernel: the rows of a step, dequantized, equal the reference lookup bit for bit, on odd
sizes, for float32 and bfloat16; on CUDA (skipped without one) it reads a table in registered host memory
in place, leaving the table where it is."""

import pytest
import torch

from kernels import engram
from kernels.formats import encode_fp8

from .kernel_check import DEVICE, assert_equal, requires_cuda, run, seed


def table(rows: int, d: int, device="cpu"):
    data, scale = encode_fp8(torch.randn(rows, d, device=device) * torch.rand(rows, 1, device=device) * 8, (1, 32))
    return data, scale


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d,t,cols", [(97, 64, 3, 5), (1000, 256, 1, 24), (13, 32, 7, 2)])
def test_the_gather_kernel_equals_the_reference_lookup(rows, d, t, cols, out_dtype):
    s = seed()
    data, scale = table(rows, d)
    ids = torch.randint(0, rows, (t, cols))
    ids[0, 0] = rows - 1  # the last row
    want = engram.reference(data, scale, ids, out_dtype)
    got = run(engram.fast, data.to(DEVICE), scale.to(DEVICE), ids.to(DEVICE), out_dtype)
    assert_equal("rows", want, got.cpu(), f"(seed {s})")


def test_the_gather_kernel_refuses_a_table_without_whole_scale_blocks():
    data, scale = table(4, 64)
    with pytest.raises(ValueError, match="scale.shape"):
        engram.fast(data, scale[:, :1].contiguous(), torch.zeros(1, 1, dtype=torch.long), torch.float32)


@requires_cuda
class TestEngramFromHostMemoryOnCuda:
    def test_the_kernel_reads_a_registered_host_table_in_place(self):
        from appliance.parallel.placement import map_to_device

        data, scale = table(5000, 256)
        where = (data.data_ptr(), scale.data_ptr())
        map_to_device(data)
        map_to_device(scale)
        ids = torch.randint(0, 5000, (2, 24), device="cuda")
        got = engram.fast(data, scale, ids, torch.bfloat16)
        assert got.device.type == "cuda" and data.device.type == "cpu" and (data.data_ptr(), scale.data_ptr()) == where
        assert_equal("rows", engram.reference(data, scale, ids.cpu(), torch.bfloat16), got.cpu())
