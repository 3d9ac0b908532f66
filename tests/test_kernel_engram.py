"""The Engram kernels (kernels/engram.py) against their references: the lookup (row ids hashed from the token
history, and those rows copied from each layer's table where it lives) bit for bit, on odd sizes and tables
of different lengths; the layer (the looked-up rows through wkv, and the gated add into the streams) on odd
sizes, for float32 and bfloat16; rows together equal rows one at a time; on CUDA (skipped without one) the
lookup reads tables in registered host memory in place, leaving them where they are.

Tolerance of the layer: one rounding of the activation dtype (the float32 product and gates against float64)."""

import pytest
import torch

import kernels._triton
from kernels import engram
from kernels.bench import fp8_weight
from kernels.formats import encode_fp8

from .kernel_check import DEVICE, assert_close, assert_rows_invariant, requires_cuda, run, seed

TOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-7}


def table(rows: int, d: int, device="cpu"):
    data, scale = encode_fp8(torch.randn(rows, d, device=device) * torch.rand(rows, 1, device=device) * 8, (1, 32))
    return data, scale


def looked_up(t: int, cols: int, hd: int, device=DEVICE):
    """Rows as a lookup returns them for one layer: codes [t, cols, hd] e4m3, scales [t, cols, hd / 32]."""
    data, scale = table(t * cols, hd, device)
    return data.view(t, cols, hd), scale.view(t, cols, hd // 32)


def layer(t, hc, d, hd, cols, dt, act_block, device=DEVICE):
    codes, scales = looked_up(t, cols, hd, device)
    X = torch.randn(t, hc, d, device=device).to(dt)
    wkv = fp8_weight((hc + 1) * d, cols * hd, (32, 32), device)
    omega = torch.randn(hc, d, device=device)
    return X, codes, scales, wkv, act_block, omega, 1e-20


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,hc,d,hd,cols,act_block", [(3, 4, 64, 64, 5, 32), (1, 2, 96, 32, 3, None),
                                                       (7, 3, 32, 32, 2, 32)])
def test_the_engram_layer_matches_the_reference(t, hc, d, hd, cols, act_block, dt):
    s = seed()
    args = layer(t, hc, d, hd, cols, dt, act_block)
    want = engram.layer_reference(*args)
    got = run(engram.fast_layer, *args)
    assert_close("streams", want, got, TOL[dt], context=f"(seed {s}, {dt}, T={t} hc={hc} D={d})")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_the_engram_layer_in_the_checkpoints_formats_matches_the_reference_and_rows_stay_invariant(native, dt):
    s = seed()
    X, codes, scales, *rest = args = layer(6, 4, 64, 64, 5, dt, 32)
    ctx = f"(seed {s}, {dt})"
    assert_close("streams", engram.layer_reference(*args), run(engram.fast_layer, *args), TOL[dt], context=ctx)
    assert_rows_invariant("streams", lambda sl: run(engram.fast_layer, X[sl], codes[sl], scales[sl], *rest),
                          context=ctx)
    assert native or not kernels._triton.INTERPRET, f"no product multiplied in the checkpoint's formats {ctx}"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_a_long_calls_engram_layer_stages_its_rows_once_and_its_chunks_give_the_same_bits(native, monkeypatch, dt):
    """Inside long_calls (a prefill chunk) the layer's product takes programs of LONG_ROWS rows
    (E4M3_LONG_ROWS on the e4m3 MMA) on the looked-up rows dequantized and quantized once by their own launch
    (rows.stage_launch): within the tolerance, and a prompt's rows give the same bits whatever its chunks."""
    from kernels import linear

    staged = []
    stage = linear.stage_launch
    monkeypatch.setattr(engram, "stage_launch", lambda *a, **k: (staged.append(1), stage(*a, **k))[1])
    s = seed()
    rows = 40
    X, codes, scales, *rest = args = layer(rows, 4, 64, 64, 5, dt, 32)
    ctx = f"(seed {s}, {dt})"
    with kernels._triton.long_calls():
        whole = run(engram.fast_layer, *args)
        parts = torch.cat([run(engram.fast_layer, X[a:b], codes[a:b], scales[a:b], *rest)
                           for a, b in ((0, 3), (3, 29), (29, rows))])
    assert torch.equal(whole, parts), f"chunks differ from one call {ctx}"
    assert_close("streams", engram.layer_reference(*args), whole, TOL[dt], context=ctx)
    assert len(staged) == 4 or not kernels._triton.INTERPRET, f"{len(staged)} stagings for 4 long calls {ctx}"
    assert native or not kernels._triton.INTERPRET, f"no product multiplied in the checkpoint's formats {ctx}"


def test_an_engram_row_does_not_depend_on_the_other_rows():
    s = seed()
    X, codes, scales, *rest = layer(6, 4, 64, 32, 4, torch.bfloat16, 32)
    assert_rows_invariant("streams", lambda sl: run(engram.fast_layer, X[sl], codes[sl], scales[sl], *rest),
                          context=f"(seed {s})")


def test_the_engram_layer_refuses_rows_without_whole_scale_blocks():
    X, codes, scales, *rest = layer(1, 2, 32, 64, 1, torch.float32, None)
    with pytest.raises(ValueError, match="scales.shape"):
        engram.fast_layer(X, codes, scales[:, :, :1].contiguous(), *rest)


def hashing(g: torch.Generator, device=DEVICE):
    """A token history and hash constants for three layers: multipliers near 2^62 (the products wrap, some
    hashes are negative before the prime's remainder), two heads a column, n-grams up to 4."""
    tokens = torch.randint(0, 700, (64,), generator=g).to(device)
    token_map = torch.randint(0, 300, (600,), generator=g).to(device)  # tokens past it clamp to its last
    mult = (torch.randint(0, 2**61, (3, 4), generator=g) * 2 + 1).to(device)
    primes = torch.tensor([[7, 11, 13, 17, 19, 23], [29, 31, 37, 41, 43, 47], [53, 59, 61, 67, 71, 73]], device=device)
    offsets = torch.cumsum(primes, 1) - primes
    return tokens, token_map, 5, mult, primes, offsets, 2


def tables_for(primes: torch.Tensor, hd: int, device="cpu"):
    """One table a layer, each as long as its columns' primes add up to (so every id is a row)."""
    pairs = [table(int(p.sum()), hd, device) for p in primes]
    return [d for d, _ in pairs], [s for _, s in pairs]


def test_the_lookup_equals_the_reference_bit_for_bit_ids_and_rows():
    """Positions at the start of the sequence (the pad id) and past it, every layer at once, each layer's
    rows from its own table; the ids within each column's range."""
    s = seed()
    g = torch.Generator().manual_seed(s)
    tokens, token_map, pad, mult, primes, offsets, heads = hashing(g)
    tables, scales = tables_for(primes, 64, DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 40, 41, 63], device=DEVICE)
    args = (tokens, positions, token_map, pad, mult, primes, offsets, heads, tables, scales)
    want = engram.lookup_reference(*args)
    got = run(engram.fast_lookup, *args)
    for name, w, o in zip(("ids", "codes", "scales"), want, got):
        assert w.dtype == o.dtype and w.shape == o.shape, f"{name}: {o.dtype} {tuple(o.shape)} (seed {s})"
        w8, o8 = (w, o) if name == "ids" else (w.view(torch.uint8), o.view(torch.uint8))
        assert torch.equal(w8, o8), f"{name} (seed {s}): {(w8 != o8).nonzero()[:5].tolist()}"
    ids = got[0]
    assert (ids >= offsets[:, None, :]).all() and (ids < (offsets + primes)[:, None, :]).all()
    assert torch.equal(ids, engram.ids_reference(*args[:8]))


def test_the_lookup_refuses_a_table_list_that_does_not_match_the_layers():
    tokens, token_map, pad, mult, primes, offsets, heads = hashing(torch.Generator().manual_seed(0))
    tables, scales = tables_for(primes, 32, DEVICE)
    positions = torch.tensor([5], device=DEVICE)
    with pytest.raises(ValueError, match=r"len\(tables\)"):
        engram.fast_lookup(tokens, positions, token_map, pad, mult, primes, offsets, heads, tables[:2], scales[:2])
    with pytest.raises(ValueError, match=r"scales\[1\].shape"):
        engram.fast_lookup(tokens, positions, token_map, pad, mult, primes, offsets, heads, tables,
                           [scales[0], scales[1][:, :0].contiguous(), scales[2]])


@requires_cuda
class TestEngramFromHostMemoryOnCuda:
    def test_the_lookup_reads_registered_host_tables_in_place(self):
        from appliance.parallel.placement import map_to_device

        tokens, token_map, pad, mult, primes, offsets, heads = hashing(torch.Generator().manual_seed(seed()))
        tables, scales = tables_for(primes * 1000, 256)  # on the host
        where = [t.data_ptr() for t in (*tables, *scales)]
        for t in (*tables, *scales):
            map_to_device(t)
        positions = torch.arange(64, device=DEVICE)
        args = (tokens, positions, token_map, pad, mult, primes * 1000, offsets * 1000, heads, tables, scales)
        got = engram.fast_lookup(*args)
        assert all(o.device.type == "cuda" for o in got)
        assert all(t.device.type == "cpu" for t in (*tables, *scales))
        assert [t.data_ptr() for t in (*tables, *scales)] == where
        want = engram.lookup_reference(*args)  # gathers on the host
        for w, o in zip(want, got):
            assert torch.equal(w.view(torch.uint8) if w.dtype != torch.int64 else w,
                               o.view(torch.uint8) if o.dtype != torch.int64 else o)


class Slices:
    """parallel/sharding.py EngramSplit for rank `rank` of `world` made-up ranks, each holding rows [r width,
    (r + 1) width) of wkv (whole scale blocks, the last rank the rest): `gather_produced` gives the consumer
    every rank's product, the others' made by the same launch on their rows (`Mine` captures it)."""

    def __init__(self, args, world: int, rank: int):
        self.args, self.world, self.rank = args, world, rank
        wkv = args[3]
        blocks = -(-wkv.shape[0] // wkv.block[0])
        self.width = -(-blocks // world) * wkv.block[0]
        self.weight = self.rows(rank)

    def rows(self, r: int):
        wkv = self.args[3]
        return wkv.rows(r * self.width, min(wkv.shape[0], (r + 1) * self.width))

    def gather_produced(self, shape, produce, consume):
        parts = [produce(None) if r == self.rank else engram.fast_layer(*self.args, split=Mine(self, r))
                 for r in range(self.world)]
        assert all(tuple(p.shape) == shape and p.dtype == torch.float32 for p in parts), [p.shape for p in parts]
        return consume(parts)


class Mine:
    """Rank r's launch of a split layer, stopped at its product (what it would send)."""

    def __init__(self, slices: Slices, r: int):
        self.width, self.weight = slices.width, slices.rows(r)

    def gather_produced(self, shape, produce, consume):
        return produce(None)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_a_layer_split_over_ranks_gives_one_devices_bits(native, dt):
    """Each rank's launch multiplies its rows of wkv into its columns of kv, and the gates' launch gathers
    every rank's columns as it loads them: the streams one device's launch gives, bit for bit, for 2 and 4
    ranks (4: 96, 96, 96 and 32 of wkv's 320 rows, whole scale blocks of 32)."""
    s = seed()
    t = int(torch.randint(1, 7, ()))
    args = layer(t, 4, 64, 64, 5, dt, 32)
    whole = run(engram.fast_layer, *args)
    for world in (2, 4):
        rank = int(torch.randint(world, ()))
        ctx = f"(seed {s}, {dt}, {t} rows, rank {rank} of {world})"
        got = run(engram.fast_layer, *args, split=Slices(args, world, rank))
        assert torch.equal(whole, got), f"streams differ {ctx}: {(whole.float() - got.float()).abs().max()}"


def test_a_split_layer_refuses_rows_of_another_width_naming_the_field():
    args = layer(2, 4, 64, 64, 5, torch.float32, 32)
    split = Slices(args, 4, 1)
    split.weight = args[3].rows(0, 128)  # wider than the ranks' stride of 96
    with pytest.raises(ValueError, match=r"split\.weight\.shape"):
        engram.fast_layer(*args, split=split)
