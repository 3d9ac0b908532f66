"""Where a split model's weights live (appliance/parallel/sharding.py): the MoE's experts (`shard_moe`), every
rank a share of each expert's intermediate, or whole experts per rank, `--experts` choosing, auto by whether
the slices keep the checkpoint's scale blocks whole; the attention's query heads split and its indexer whole
(`shard_attention`); an Engram layer's wkv split by outputs on the fast path (`shard_engram`). (The four-rank
runs in test_distributed.py check what the ranks compute.)"""

from types import SimpleNamespace

import pytest
import torch

from appliance.errors import ApplianceError
from appliance.parallel.sharding import Comm, shard_attention, shard_engram, shard_moe
from kernels.bench import fp4_weight, fp8_weight


def moe(inter: int, experts: int = 8, dim: int = 64):
    return SimpleNamespace(experts=[(fp4_weight(inter, dim, "cpu"), fp4_weight(dim, inter, "cpu"),
                                     fp4_weight(inter, dim, "cpu")) for _ in range(experts)], shared=None)


@pytest.mark.parametrize("rank", [0, 3])
def test_experts_split_by_their_intermediate_where_the_fp4_scale_blocks_stay_whole(rank):
    m = moe(128)
    whole = [tuple(w.dequantize() for w in e) for e in m.experts]
    shard_moe(m, Comm(rank, 4))
    lo, hi = 32 * rank, 32 * (rank + 1)
    assert all(e is not None for e in m.experts)
    for (w1, w2, w3), (d1, d2, d3) in zip(m.experts, whole):
        assert w1.shape == (32, 64) and w2.shape == (64, 32) and w3.shape == (32, 64)
        assert w1.dequantize().equal(d1[lo:hi]) and w3.dequantize().equal(d3[lo:hi])
        assert w2.dequantize().equal(d2[:, lo:hi])


def test_experts_too_narrow_to_split_stay_whole_under_auto_and_split_refuses_naming_the_option():
    m = moe(64)  # 16 columns of w2 a rank: half an FP4 scale block
    shard_moe(m, Comm(1, 4))
    assert [e is not None for e in m.experts] == [False, False, True, True, False, False, False, False]
    with pytest.raises(ApplianceError) as e:
        shard_moe(moe(64), Comm(1, 4), "split")
    assert e.value.field == "experts" and "--experts" in e.value.message


def test_whole_experts_when_asked_even_where_they_split():
    m = moe(128)
    shard_moe(m, Comm(2, 4), "whole")
    assert [e is not None for e in m.experts] == [False, False, False, False, True, True, False, False]
    assert m.experts[4][0].shape == (128, 64)


def engram_layer(rows: int, path: str = "fast"):
    return SimpleNamespace(wkv=SimpleNamespace(weight=fp8_weight(rows, 64, (32, 32))), split=None,
                           rt=SimpleNamespace(ops=SimpleNamespace(path=path)))


@pytest.mark.parametrize("rank", [0, 3])
def test_an_engram_layers_wkv_splits_by_outputs_in_whole_blocks_on_the_fast_path(rank):
    """320 rows of 32-row scale blocks over four ranks: 96 a rank in every rank's stride, the last rank the
    32 left; the reference path and a wkv of fewer blocks than ranks stay whole."""
    e = engram_layer(320)
    whole = e.wkv.weight.dequantize()
    shard_engram(e, Comm(rank, 4))
    lo, hi = 96 * rank, min(320, 96 * (rank + 1))
    assert e.split.width == 96 and e.split.weight.shape == (hi - lo, 64)
    assert e.split.weight.dequantize().equal(whole[lo:hi]) and e.wkv.weight.shape == (320, 64)
    for kept in (engram_layer(320, "reference"), engram_layer(96)):
        shard_engram(kept, Comm(rank, 4))
        assert kept.split is None


@pytest.mark.parametrize("rank", [0, 2])
def test_query_heads_split_and_the_indexer_stays_whole_on_every_rank(rank):
    """Each rank a quarter of the attention's query heads; every index head on every rank (the same scores
    and rows as one device, nothing sent over the links)."""
    from tests.conftest import load

    model = load(None).model  # the embedded tiny V4.1
    attn = next(layer.attn for layer in model.layers if getattr(layer.attn, "iq", None) is not None)
    iq, weights = attn.iq.weight, attn.weights_proj.weight
    q_rows, heads = attn.wq_b.weight.shape[0], attn.heads
    shard_attention(attn, Comm(rank, 4))
    assert attn.heads == heads // 4 and attn.wq_b.weight.shape[0] == q_rows // 4
    assert attn.iq.weight is iq and attn.weights_proj.weight is weights


def test_a_long_calls_rows_are_shared_out_once_each_and_gathered_back_in_order():
    """appliance/model/rowsplit.py: each rank a contiguous share of a call's rows (a decode step's few rows
    not split), every row exactly once; gathered back (booleans too) in row order, whatever the remainder."""
    from appliance.model.rowsplit import ALL_ROWS, SPLIT_ROWS, gather_rows, query_share

    class Gathering:  # four ranks' all_gather: each rank's part of `full`, as rank `rank` sees them
        def __init__(self, rank, full):
            self.rank, self.world, self.full = rank, 4, full

        def all_gather(self, t, dim):
            parts = []
            for r in range(self.world):
                p = self.full[query_share(Gathering(r, None), self.full.shape[0])]
                if p.dtype == torch.bool:
                    p = p.to(torch.uint8)
                per = -(-self.full.shape[0] // self.world)
                parts.append(torch.cat((p, p.new_zeros((per - p.shape[0], *p.shape[1:])))))
            assert parts[self.rank].shape == t.shape and parts[self.rank].equal(t)
            return torch.cat(parts, dim)

    assert query_share(Gathering(0, None), SPLIT_ROWS) == ALL_ROWS and query_share(None, 100) == ALL_ROWS
    rows = int(torch.randint(SPLIT_ROWS + 1, 200, ()))
    shares = [query_share(Gathering(r, None), rows) for r in range(4)]
    assert torch.cat([torch.arange(rows)[s] for s in shares]).equal(torch.arange(rows))
    for full in (torch.randint(-1, 50, (rows, 7)), torch.rand(rows, 5) > 0.5):
        for rank in range(4):
            comm = Gathering(rank, full)
            assert gather_rows(comm, full[query_share(comm, rows)], rows).equal(full)


def sums_by_rows(world, seed: int) -> dict:
    """Every rank of four: a 23-token forward on the fast path (shares of 6 rows, the last one short and
    padded; and 9 tokens, whose last share is empty; plain numerics: no activation quantization, whose
    boundaries a reordered sum can cross), its
    streams held by rows (model.Step.share): the attention's output product whole for a rank's rows
    (sharding.RowParallel.exchange), the MoE's sums by rows (ExpertReduce.share); again with every sum whole
    and the streams whole. How many all-to-alls went, and of them sums; how far the logits are (relative to a
    row's largest); whether the indexer's selection by block maxima (each rank its share of the queries) gives
    the same bits; whether the exchange gives this rank's rows of every column, bit for bit."""
    from appliance.loader import load_model
    from appliance.model import deepseek_v41, step
    from appliance.model.rowsplit import ALL_ROWS, query_share
    from appliance.options import RunOptions
    from appliance.parallel import sharding

    lm = load_model(RunOptions(devices="cpu:4", path="fast", numerics="plain"), notice=None, world=world)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.cfg.vocab_size, (23,), generator=gen)
    calls = {"exchange": 0}
    for name in calls:
        method = getattr(sharding.Comm, name)
        setattr(sharding.Comm, name, lambda self, *a, _m=method, _n=name: calls.update({_n: calls[_n] + 1})
                or _m(self, *a))

    def logits(rows: int = 23):
        return lm.model.forward(ids[:rows], lm.model.new_state(64)).logits.float()

    by_rows = logits()
    counted = dict(calls)
    nine = logits(9)  # shares of 3: the last rank's is empty
    # the indexer's selection by block maxima taken wherever it can be (the tiny model's keys are few)
    narrowed, by_maxima, gain = [], deepseek_v41.blocks_by_maxima, deepseek_v41.MAXIMA_GAIN

    def maxima(*args):
        out = by_maxima(*args)
        narrowed.append(out is not None)
        return out

    deepseek_v41.MAXIMA_GAIN, deepseek_v41.blocks_by_maxima = 0, maxima
    maxima_equal = torch.equal(by_rows, logits())
    deepseek_v41.MAXIMA_GAIN, deepseek_v41.blocks_by_maxima = gain, by_maxima
    wo_b = lm.model.layers[0].attn.out.wo_b
    u = torch.randn(23, world.size * wo_b.weight.shape[1], generator=gen).to(torch.bfloat16)
    cols = u.shape[1] // world.size
    exchanged = wo_b.exchange(u[:, world.rank * cols:(world.rank + 1) * cols])
    exchange_exact = torch.equal(exchanged, u[query_share(wo_b.comm, 23)])
    sharding.query_share = step.query_share = lambda comm, rows: ALL_ROWS  # every sum whole
    whole, whole_nine = logits(), logits(9)

    def error(a, b):
        return ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()

    return {"calls": counted, "layers": len(lm.model.layers), "maxima_equal": maxima_equal,
            "narrowed": any(narrowed), "exchange_exact": exchange_exact, "rows": int(by_rows.shape[0]),
            "error": max(error(by_rows, whole), error(nine, whole_nine))}


def test_four_ranks_sum_a_long_calls_attention_outputs_and_experts_by_rows(tmp_path):
    """A prefill chunk held by rows: the attention's output product is one device's for a rank's rows (each
    rank sends each other its share's rows of its o-LoRA columns, an all-to-all in bfloat16); the MoE's sum,
    each rank receiving every rank's sums of its share of the rows only (an all-to-all), is associated by
    rank: within float32 rounding of the whole sums (2^-16 of a row's largest logit, as
    tests/test_distributed.py's four ranks)."""
    from .ranks import call

    for rank in call("tests.test_sharding:sums_by_rows", tmp_path, world=4, timeout=600,
                     seed=int(torch.randint(1 << 30, ()))):
        layers = rank["layers"]
        assert rank["calls"] == {"exchange": 2 * layers}, rank  # the attention's o-LoRA rows, the MoE's sums
        assert rank["exchange_exact"] and rank["rows"] == 23, rank
        assert rank["narrowed"] and rank["maxima_equal"], rank  # the indexer by block maxima: the same bits
        assert rank["error"] <= 2.0**-16, rank


def v4_by_rows(world, model_dir: str, seed: int) -> dict:
    """Every rank of four: V4's backbone and its MTP head on the fast path (plain numerics), a 23-token long
    call held by rows (the V4 block's sub-blocks gathered, the hash-routed layers' MoE, the final collapse's
    logits and the streams gathered) and the MTP head's commit of those streams (a long call of its own),
    then the same with every sum and the streams whole: how far the logits and the head's ring are."""
    from appliance.loader import load_model
    from appliance.model import step
    from appliance.model.rowsplit import ALL_ROWS
    from appliance.options import RunOptions
    from appliance.parallel import sharding

    lm = load_model(RunOptions(model_dir=model_dir, devices="cpu:4", path="fast", numerics="plain", draft="auto"),
                    notice=None, world=world)
    ids = torch.randint(0, lm.cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(seed))

    def forward():
        out = lm.model.forward(ids, lm.model.new_state(64), keep_streams=True)
        head = lm.drafter.new_state(64)
        lm.drafter.commit(head, out.streams, torch.cat((ids[1:], ids[:1])), 0)
        return out.logits.float(), torch.cat([r.data.float().flatten() for r in head.rings.values()])

    exchanges = []
    exchange = sharding.Comm.exchange
    sharding.Comm.exchange = lambda self, t: exchanges.append(t.dtype) or exchange(self, t)
    by_rows = forward()
    sharding.query_share = step.query_share = lambda comm, rows: ALL_ROWS
    whole = forward()

    def error(a, b):
        return ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()

    return {"kind": lm.drafter.kind, "logits": error(by_rows[0], whole[0]), "ring": error(by_rows[1], whole[1]),
            "blocks": len(lm.model.layers) + 1, "exchanges": len(exchanges)}


def test_four_ranks_hold_a_v4_long_calls_streams_by_rows_and_its_mtp_head_commits_them(tiny_dirs, tmp_path):
    """V4's blocks and MTP head split over four ranks take a long call by rows as V4.1's do: its logits and
    the head's ring rows within float32 rounding of every sum whole (2^-16 of the largest, as above)."""
    from .ranks import call

    for rank in call("tests.test_sharding:v4_by_rows", tmp_path, world=4, timeout=600,
                     model_dir=str(tiny_dirs["deepseek_v4"]), seed=int(torch.randint(1 << 30, ()))):
        assert rank["kind"] == "mtp" and rank["exchanges"] == 2 * rank["blocks"], rank  # wo_b's and the MoE's
        assert rank["logits"] <= 2.0**-16 and rank["ring"] <= 2.0**-16, rank
