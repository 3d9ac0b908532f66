"""Shared test fixtures: tiny checkpoints (written once per session), the official-reference fixture data,
and the CPU/GPU switch (without CUDA, Triton kernels run under the interpreter)."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs as two workers on two cores (Makefile): more intra-op threads than one per process only spin
# against each other, here and in the appliance processes tests start (their loader reads APPLIANCE_THREADS)
os.environ.setdefault("APPLIANCE_THREADS", "1")
torch.set_num_threads(int(os.environ["APPLIANCE_THREADS"]))

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "v41-tiny-a"
FIXTURE_EXPECTED = DATA / "v41-tiny-a-expected"


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (minutes each: long generations, the interpreter, subprocess ranks, fixed waits) run
    first, so that two workers share them and finish together (the Makefile hands tests out a few at a time
    in this order: `--dist loadgroup --no-loadscope-reorder`); the many short tests fill in behind. A stable
    sort: file order otherwise."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    from appliance.cli.tiny_checkpoint import FAMILIES, write_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny(root / f, f, seed=0) for f in FAMILIES}


@pytest.fixture(scope="session")
def expected():
    from safetensors.torch import load_file

    return load_file(str(FIXTURE_EXPECTED / "expected.safetensors"))


def load(model_dir, **options):
    """A loaded model with these run options (appliance.options.RunOptions fields), quietly."""
    from appliance.loader import load_model
    from appliance.options import RunOptions

    return load_model(RunOptions(model_dir=model_dir, **options), notice=None)


def open_loop(lm, capacity: int | None = 1024, reach_floor: int = 4096, **options):
    """A request loop over a fresh decode session of `lm` (its `.session` holds the state)."""
    from appliance.decode.loop import RequestLoop
    from appliance.decode.session import DecodeSession
    from appliance.options import RunOptions

    session = DecodeSession(lm, RunOptions(**options), capacity=capacity, reach_floor=reach_floor)
    return RequestLoop(session, lm.tokenizer, lm.model_dir)


@pytest.fixture(scope="session")
def fixture_model():
    return load(FIXTURE, draft="auto")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


NATIVE_KINDS = {"block-scaled": "NATIVE_BLOCK_SCALED", "e4m3": "NATIVE_E4M3"}


def use_native_products(monkeypatch, kind: str) -> list:
    """The weight products multiply in the checkpoint's formats on the tensor cores, as `kind` (NATIVE_KINDS:
    sm_100 and later, sm_89/90) does: on a device, as the device does whatever the kind; under the
    interpreter, as the kind does, and the products it makes are counted (the list's length)."""
    import kernels._triton
    from kernels import linear

    made = []
    monkeypatch.setattr(kernels._triton, "NATIVE_INTERPRET", getattr(kernels._triton, NATIVE_KINDS[kind]))
    if kernels._triton.INTERPRET:
        name = {"block-scaled": "mxf_mma", "e4m3": "e4m3_product"}[kind]
        product = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *a: (made.append(1), product(*a))[1])
    return made


@pytest.fixture(params=list(NATIVE_KINDS))
def native(request, monkeypatch):
    """Each way of multiplying in the checkpoint's formats (use_native_products)."""
    return use_native_products(monkeypatch, request.param)
