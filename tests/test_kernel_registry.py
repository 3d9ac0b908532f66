"""The op registry's fast path: every op is served by a kernel and says so, unknown paths and machines
where Triton cannot run are refused with the reason (never a silent fallback), and `appliance bench
kernels` says plainly when it has nothing to measure."""

import json

import pytest
import torch
from click.testing import CliRunner

from kernels import _triton, bench, registry

from .kernel_check import CUDA


def test_the_fast_path_serves_every_op_with_a_kernel():
    ops = registry.resolve("fast")
    assert ops.path == "fast"
    assert ops.kernels() == ops.names()
    assert registry.resolve("reference").kernels() == []


def test_describe_names_each_op_and_the_function_that_serves_it():
    text = registry.resolve("fast").describe()
    for name in registry.FAST.names():
        assert f"  {name} " in text
    assert "ffn             kernel    kernels.moe.fast_ffn" in text
    assert "linear          reference kernels.linear.reference" in registry.resolve("reference").describe()


def test_an_unknown_op_path_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="op path 'quick': must be 'reference' or 'fast'"):
        registry.resolve("quick")


def test_the_fast_path_is_refused_with_the_reason_where_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device and TRITON_INTERPRET is not 1"):
        registry.resolve("fast")


@pytest.mark.skipif(CUDA, reason="checks the CPU message")
def test_bench_kernels_without_cuda_says_it_measures_nothing():
    notes = []
    assert bench.run(notice=notes.append, tiny=False) == []
    assert "no CUDA device" in notes[0] and "nothing measured" in notes[0]
    from appliance.cli import main

    out = CliRunner().invoke(main, ["bench", "kernels", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["measured"] is False and doc["results"] == [] and "no CUDA device" in doc["notes"][0]


def test_bench_table_reports_bandwidth_and_fraction_of_copy():
    r = bench.Result("linear wq_a fp8", "[1280, 5120]", 1, 2.0, 6_600_000, 3300.0, 0.8)
    text = bench.table([r])
    assert "GB/s" in text and "3300.0" in text and "80%" in text
    assert bench.as_json([r])[0]["fraction"] == 0.8
