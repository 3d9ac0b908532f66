"""The cycle recorder and the counts built on it (appliance/measure/recorder.py, count.py): what is a launch,
a host sync, a byte read; one decode cycle counted on the meta device; the cost model's arithmetic."""

import argparse
import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from appliance.cli import main
from appliance.measure import costmodel as cm
from appliance.measure.recorder import Recorder


def launches(step) -> Recorder:
    with Recorder() as rec:
        step()
    return rec


def test_every_computing_operation_is_one_launch_and_views_allocations_and_host_scalars_are_none():
    x = torch.randn(4, 8)

    def step():
        y = x * 2.0                      # launch
        z = y.view(8, 4).t()             # views
        out = torch.empty(4, 8)          # allocation
        out.copy_(z)                     # launch
        s = torch.tensor(0.5) * 2.0      # host scalar arithmetic
        return out + s                   # launch

    rec = launches(step)
    assert [la.name for la in rec.launches] == ["mul.Tensor", "copy_", "add.Tensor"]
    assert rec.syncs == [] and rec.violations == []


def test_an_extra_operation_in_a_step_changes_the_count():
    x = torch.randn(16)
    base = len(launches(lambda: (x + 1).relu()).launches)
    assert len(launches(lambda: (x + 1).relu().neg()).launches) == base + 1


def test_host_reads_are_syncs_and_capture_violations_and_not_launches():
    x = torch.randn(8)

    def step():
        n = int(x.sum())                 # a launch (sum) and a host read
        x.tolist()                       # a copy to the host
        return x[x > 0], n               # a launch (gt), boolean-mask indexing

    rec = launches(step)
    whys = [s["why"] for s in rec.syncs]
    assert len(whys) == 3 and any("tolist" in w for w in whys) and any("boolean-mask" in w for w in whys)
    assert len(rec.violations) == 3
    assert all(la.name != "_local_scalar_dense" for la in rec.launches)


def test_each_input_is_read_once_a_gather_reads_its_rows_and_a_fresh_output_is_not_read():
    table = torch.randn(1000, 16)
    idx = torch.tensor([3, 5, 7])
    rec = launches(lambda: table[idx] + table[idx])
    gather = rec.launches[0]
    assert gather.bytes_read == 3 * 16 * 4 + 3 * 8
    assert rec.launches[-1].bytes_read == 2 * 3 * 16 * 4  # two gathered tensors

    x = torch.randn(64)
    out = None

    def copy():
        nonlocal out
        out = torch.empty(64)
        out.copy_(x)
        return out + out                 # one input, read once

    rec = launches(copy)
    assert [la.bytes_read for la in rec.launches] == [64 * 4, 64 * 4]


def test_declared_gathers_and_reads_through_tables_replace_what_the_tensors_would_say():
    cache = torch.randn(4096, 64)
    table = torch.zeros(4, dtype=torch.long)
    with Recorder() as rec:
        with rec.gather(cache, 10 * 64 * 4):
            cache[:100].sum()
        rec.read_through(table, 12345, "experts")
        table.sum()
        table.sum()
    assert [la.bytes_read for la in rec.launches] == [10 * 64 * 4, 12345 + 32, 32]


def test_a_launch_writes_its_results_a_kernels_fresh_outputs_an_indexed_writes_values_and_what_is_declared():
    from kernels import rmsnorm

    rows, d = (int(v) for v in torch.randint(2, 9, (2,)))
    x, weight = torch.randn(rows, d * 8), torch.rand(d * 8)
    ring, idx, vals, w8 = torch.zeros(50, 8), torch.tensor([1, 4]), torch.randn(2, 8), torch.rand(8)
    with Recorder() as rec:
        y = x * 2.0                                   # a result: written
        y.add_(1.0)                                   # in place: written again
        out = rmsnorm.fast(y, weight, 1e-6)           # a Triton kernel's fresh output
        ring.index_put_((idx,), vals)                 # the two rows it writes, not the ring
        with rec.writes(ring, 123):
            rmsnorm.fast(ring, w8, 1e-6)              # declared: 123 bytes of the ring, none read
            ring.add_(1.0)
        rmsnorm.fast(out, weight, 1e-6)               # its input was written before: read
    row = rows * d * 8 * 4
    kernel = [la for la in rec.launches if la.kind == "triton"]
    assert [la.bytes_written for la in rec.launches if la.kind == "torch"] == [row, row, 2 * 8 * 4, 123]
    assert [la.bytes_written for la in kernel] == [row, 123 + 50 * 8 * 4, row]
    assert [la.bytes_read for la in kernel] == [row + d * 8 * 4, 8 * 4, row + d * 8 * 4]


def test_a_launch_that_touches_a_float64_tensor_is_counted_with_its_place():
    x, i = torch.randn(8), torch.arange(8)

    def step():
        y = x * 2.0                      # float32: not counted
        z = (i.double() + 1).sum()       # the conversion writes float64, the add and the sum read it
        return y + torch.tensor(0.5, dtype=torch.float64), z  # a float64 host scalar is an argument, not a read

    with Recorder() as rec:
        step()
    assert [f["name"] for f in rec.float64] == ["_to_copy", "add.Tensor", "sum"]
    assert all(f["where"] and f["where"][-1].startswith("tests/test_measure_counts.py") for f in rec.float64)
    assert rec.summary()["float64_launches"] == 3


def test_blocks_get_what_happens_inside_them():
    x = torch.randn(8)
    with Recorder() as rec:
        x + 1
        with rec.tag("layer 0"):
            x * 2
            x - 3
    s = rec.summary()
    assert s["by_block"]["layer 0"]["launches"] == 2 and s["by_block"]["outside"]["launches"] == 1


@pytest.fixture(scope="module")
def meta_counts():
    """The embedded model's plain cycle and a k=3 DSpark cycle, counted on the meta device (no weights)."""
    from appliance.decode.session import DecodeSession
    from appliance.loader import default_model_dir
    from appliance.measure.count import count_cycle
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config
    from appliance.options import RunOptions

    mm = meta_model(load_config(default_model_dir()))

    def count(draft="none", ops=None):
        options = RunOptions(draft=draft, draft_tokens=3, path="fast", dtype="bfloat16")
        session = DecodeSession(mm, options, capacity=96, reach_floor=96)
        saved = mm.runtime.ops
        if ops is not None:
            mm.runtime.ops = ops(saved)
        try:
            return count_cycle(session, 64)
        finally:
            mm.runtime.ops = saved

    count.model = mm.model
    return count


def test_a_meta_cycle_counts_every_layer_and_reads_less_than_twice_the_ideal_at_most_where_it_should(meta_counts):
    c = meta_counts()
    assert c["cycle"] == "plain" and c["width"] == 1 and len(c["launches_by_layer"]) == 8
    assert sum(c["launches_by_layer"]) + c["launches_outside_layers"] == c["launches_per_cycle"]
    assert c["launches_per_layer"] == max(c["launches_by_layer"])
    assert c["host_syncs_per_cycle"] == 0 and c["collectives"]["per_cycle"] == 0
    b = c["bytes_per_step"]
    assert b["ratio"] == pytest.approx(b["total"] / b["ideal"])
    parts = b["ideal_parts"]
    assert parts["routed_experts"] > 0 and parts["state"] > 0
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], abs=8)
    # the token inputs: one launch reading the id, its position and the embedding table's row of the id (not
    # the table), writing the history's entry and the row's copies in the streams
    cfg = meta_counts.model.cfg
    inputs = [la for la in c["launches"] if la["name"] == "kernels.embed._inputs_kernel"]
    assert len(inputs) == 1 and inputs[0]["block"] == "outside", inputs
    assert inputs[0]["bytes_read"] == 8 + 8 + cfg.dim * 2
    assert inputs[0]["bytes_written"] == 8 + cfg.hc_mult * cfg.dim * 2


@pytest.mark.parametrize("family,draft", [("deepseek_v41", "none"), ("deepseek_v41", "dspark"),
                                          ("deepseek_v4", "mtp"), ("deepseek_v4_0731", "dspark")])
def test_no_fast_path_cycle_launches_anything_in_float64(tiny_dirs, family, draft):
    """The numerics contract: no float64 in a fast-path launch, torch operations included (sampling,
    acceptance, the drafters, the journal), counted on a meta build of each tiny family's cycle (adaptive
    drafting replays the same two steps as a fixed length; its calibration runs eagerly, not on meta)."""
    from appliance.decode.session import DecodeSession
    from appliance.measure.count import count_cycle
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config
    from appliance.options import RunOptions

    mm = meta_model(load_config(tiny_dirs[family]))
    session = DecodeSession(mm, RunOptions(draft=draft, draft_tokens=3, path="fast", dtype="bfloat16"),
                            capacity=96, reach_floor=96)
    c = count_cycle(session, 64)
    assert c["launches_per_cycle"] > 0
    assert c["float64_launches_per_cycle"] == 0, c["float64_sites"]


def test_an_extra_launch_per_mhc_site_shows_in_every_layer(meta_counts):
    def with_extra_site_launch(ops):  # a site takes the streams, or (expand_pre) an output to add to them
        def hc_pre(X, *args, **kwargs):
            return ops.hc_pre(X.clone(), *args, **kwargs)

        def hc_expand_pre(y, X, *args, **kwargs):
            return ops.hc_expand_pre(y, X.clone(), *args, **kwargs)
        return dataclasses.replace(ops, hc_pre=hc_pre, hc_expand_pre=hc_expand_pre)

    base, more = meta_counts(), meta_counts(ops=with_extra_site_launch)
    grown = [b - a for a, b in zip(base["launches_by_layer"], more["launches_by_layer"])]
    assert all(g == 2 for g in grown)  # the attention's and the MoE's site, in every layer
    assert more["launches_per_cycle"] == base["launches_per_cycle"] + sum(grown) + (
        more["launches_outside_layers"] - base["launches_outside_layers"])


def test_a_layers_moe_is_combined_by_the_next_site_the_last_by_the_final_collapse_but_not_before_engram(
        meta_counts):
    """A decode step's MoE output is left to the next layer's attention site (kernels/moe.py `pending`), the last
    layer's to the final collapse's launch: the MoE's own combine launches only in a layer whose next is an
    Engram layer (Engram reads the streams first)."""
    c = meta_counts()
    combines = [la["block"] for la in c["launches"] if la["name"].endswith("._combine_kernel")]
    layers = meta_counts.model.layers
    assert "outside" not in combines
    assert sorted({int(b.split()[1]) for b in combines}) == [L for L in range(len(layers) - 1)
                                                             if layers[L + 1].engram is not None]


def test_a_drafting_cycle_counts_the_stages_and_the_verify_of_k_plus_one_rows(meta_counts):
    c = meta_counts("dspark")
    assert c["width"] == 4 and c["cycle"] == "dspark k=3"
    assert c["launches_per_draft_stage"] > 0 and c["draft_stage_calls"] == 3
    assert c["bytes_per_step"]["ideal_parts"]["routed_experts"] > meta_counts()["bytes_per_step"]["ideal_parts"][
        "routed_experts"]


def test_four_ranks_on_the_meta_device_count_their_collectives():
    from appliance.decode.session import DecodeSession
    from appliance.loader import default_model_dir
    from appliance.measure.count import count_cycle
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config
    from appliance.options import RunOptions

    def counted(allreduce: str) -> dict:
        mm = meta_model(load_config(default_model_dir()), world=4, drafter=False, allreduce=allreduce)
        session = DecodeSession(mm, RunOptions(path="fast", dtype="bfloat16"), capacity=40, reach_floor=40)
        return count_cycle(session, 16, world=4)

    c, gathered = counted("symm"), counted("nccl")
    assert c["collectives"]["per_layer"] >= 2  # the output projection's and the MoE's reductions
    assert c["host_syncs_per_cycle"] == 0 and c["capture_violations"] == []  # the MoE's fused kernels too
    # over symmetric memory every sum's consumer waits inside its kernel: the same collectives as gathered (the
    # head's logits stay an all-gather); a decode cycle's sums are published by their producers (the
    # attention's output product, the MoE's down kernel), so no launch is added; priced as the wait and the
    # peers' partials
    publishes = sum(1 for la in c["launches"] if la["name"] == "kernels.rank_sum._publish_kernel")
    sums = sum(p["count"] for p in c["collectives"]["payloads"] if p["op"] == "symm_")
    assert sums > 0 and publishes == 0
    assert c["collectives"]["per_cycle"] == gathered["collectives"]["per_cycle"]
    assert {p["op"] for p in gathered["collectives"]["payloads"]} == {"allgather_"}
    assert c["launches_per_cycle"] == gathered["launches_per_cycle"]
    # ... each launch writes what it writes gathered (a producer its partial, not its symmetric buffer) and
    # moves the same bytes but for the flags words its publish or its wait touches (int64 [world + 1] a rank)
    written = [[la["bytes_written"] for la in x["launches"]] for x in (c, gathered)]
    assert written[0] == written[1]
    moved = [[la["bytes_read"] + la["bytes_written"] for la in x["launches"]] for x in (c, gathered)]
    assert all(0 <= a - b <= 4 * 5 * 8 for a, b in zip(*moved, strict=True)) and moved[0] != moved[1]
    gpu = cm.GPUS["b300"]
    payload = int(torch.randint(1, 10**6, ()))
    assert cm.collective_s("symm_", payload, 4, gpu) == pytest.approx(
        cm.SYMM_WAIT_S + 3 * payload / gpu.nvlink_bytes_per_s)  # each rank reads its three peers' partials
    priced = [cm.cycle_time(x, gpu, 4)["terms_s"]["collectives"] for x in (c, gathered)]
    assert priced[0] < priced[1]
    single = meta_model(load_config(default_model_dir()), drafter=False)
    one = count_cycle(DecodeSession(single, RunOptions(path="fast", dtype="bfloat16"), capacity=40,
                                    reach_floor=40), 16)
    assert c["bytes_per_step"]["ideal"] < one["bytes_per_step"]["ideal"]


def _launch(name="copy_", bytes_read=0, weights=None, routed_bytes=0, routed_weights=None, routing=None,
            host_bytes=0, flops=None, staged_bytes=0, path="", bytes_written=0, phase_waits=0) -> dict:
    return {"kind": "triton" if name.startswith("kernels.") else "torch", "name": name, "block": "layer 0",
            "bytes_read": bytes_read, "bytes_written": bytes_written,
            "weights": weights or {},
            "routed_bytes": routed_bytes, "routed_weights": routed_weights or {}, "routing": routing,
            "whole_experts": routing is not None, "host_bytes": host_bytes, "flops": flops or {},
            "staged_bytes": staged_bytes, "path": path or ("native" if weights else ""), "phase_waits": phase_waits}


def test_the_cost_model_prices_each_launch_at_its_bound_plus_imbalance_launches_collectives_and_host_link():
    gpu = cm.GPU("toy", hbm_bytes_per_s=1e12, memory_bytes=1e11, nvlink_bytes_per_s=1e11, source="test",
                 arch=103, issue_per_s=1e12, tensor_flops={"fp8": 1e14})
    per = cm.ISSUE_PER_ELEMENT[103][("moe", "fp4")]
    copy = _launch(bytes_read=int(torch.randint(10**6, 10**8, ()).item()),
                   bytes_written=int(torch.randint(10**6, 10**8, ()).item()))
    # an expert launch whose instructions outweigh its bytes: 8e6 fp4 elements (4 MB) issue per x 8e6; a decode
    # step's router and experts, three phases of one launch (two waits)
    moe = _launch("kernels.moe._step_kernel", bytes_read=4_000_000, weights={"fp4": 8_000_000},
                  routed_bytes=3_000_000, routed_weights={"fp4": 6_000_000}, routing=(256, 6, 1), phase_waits=2)
    host = _launch("kernels.engram._lookup_kernel", bytes_read=30_000, host_bytes=20_000)
    count = {"bytes_per_step": {"total": 10**9, "ideal": 5 * 10**8}, "launches": [copy, moe, host],
             "launches_by_layer": [3], "launches_outside_layers": 0, "width": 1,
             "collectives": {"payloads": [{"op": "allreduce_", "bytes": 1_000_000, "count": 10}]},
             "host_link": {"bytes_per_cycle": 20_000, "launches_per_cycle": 1}}
    copy_bw = 1e12 * cm.COPY_FRACTION
    one = cm.cycle_time(count, gpu, world=1)
    t = one["terms_s"]
    # what it reads and what it writes; the lookup is bound by the link
    assert t["bytes"] == pytest.approx((copy["bytes_read"] + copy["bytes_written"]) / copy_bw)
    assert t["issue"] == pytest.approx(8e6 * per / 1e12)  # the MoE launch is bound by issue, not its 4 MB
    assert t["host_link"] == pytest.approx(cm.HOST_READ_LATENCY_S + 20e3 / gpu.host_link_bytes_per_s)
    # the copy a torch operation, the MoE launch and the lookup Triton kernels launched dependent (sm_103), the
    # MoE launch's two waits between its phases
    assert t["launches"] == pytest.approx(cm.LAUNCH_S + 2 * cm.LAUNCH_PDL_S + 2 * cm.PHASE_WAIT_S)
    assert cm.cycle_time(count, dataclasses.replace(gpu, arch=0), world=1)["terms_s"]["launches"] == pytest.approx(
        3 * cm.LAUNCH_S + 2 * cm.PHASE_WAIT_S)  # a GPU without dependent launch
    assert t["collectives"] == 0 and t["imbalance"] == 0
    assert {k["kernel"]: k["bound"] for k in one["kernels"]} == {
        "copy_": "bytes", "kernels.moe._step_kernel": "issue", "kernels.engram._lookup_kernel": "host_link"}
    assert one["cycle_s"] == pytest.approx(sum(t.values()))
    four = cm.cycle_time(count, gpu, world=4)
    share = cm.busiest_share(256, 6, 1, 4)
    assert four["terms_s"]["imbalance"] == pytest.approx((share - 1) * 6e6 * per / 1e12)
    assert four["terms_s"]["collectives"] == pytest.approx(10 * (cm.ALLREDUCE_LATENCY_S + 1e6 * 2 * 3 / 4 / 1e11))
    p = cm.predict(count, gpu, world=4, tokens_per_cycle=3.5)
    assert p["counted"]["tokens_per_s"] == pytest.approx(3.5 / p["counted"]["cycle_s"])
    # the budget's 16 a layer are Triton kernels
    assert p["ideal_bytes_and_launch_budget"]["terms_s"]["launches"] == pytest.approx(16 * cm.LAUNCH_PDL_S)


def test_the_busiest_rank_holds_more_than_the_mean_under_uniform_routing_and_as_measured():
    """Six of 256 experts a row over four ranks: the busiest rank holds 2.80 of the 6 of a plain step (issue
    30's exact figure) within the simulation's error; measured routing that always picks one rank's experts
    puts all of them there (4x the mean); six spread as evenly as they go (2, 2, 1, 1) give 2 / 1.5."""
    assert cm.busiest_share(256, 6, 1, 4) == pytest.approx(2.80 / 1.5, rel=0.02)
    assert cm.busiest_share(256, 6, 4, 4) > cm.busiest_share(256, 6, 1, 4) * 0.6
    assert cm.busiest_share(256, 6, 1, 1) == 1.0
    lopsided = [[[0, 1, 2, 3, 4, 5]]] * 10
    assert cm.busiest_share(256, 6, 1, 4, routing=lopsided) == pytest.approx(4.0)
    even = [[[0, 64, 128, 192, 1, 65]], [[2, 66, 130, 194, 3, 67]]]
    assert cm.busiest_share(256, 6, 1, 4, routing=even) == pytest.approx(2 / 1.5)


def test_the_engram_lookup_reads_the_rows_it_looks_up_from_host_memory_not_its_tables(meta_counts, monkeypatch):
    """The released tables are ~100 GB in host memory: the step's one lookup reads each position's rows over
    the host link (width x layers x columns rows of d + d/32 bytes), and tables 100x longer change nothing."""
    from appliance.measure import count as count_module

    monkeypatch.setattr(count_module, "HOST_TABLE_BYTES", 0)  # the tiny tables where the released ones live
    engrams = [layer.engram for layer in meta_counts.model.layers if getattr(layer, "engram", None) is not None]
    e = meta_counts.model.cfg.engram
    rows = len(engrams) * (e.max_ngram - 1) * e.n_heads * (e.head_dim + e.head_dim // 32)
    base = meta_counts()
    assert base["host_link"] == {"bytes_per_cycle": rows, "launches_per_cycle": 1}
    assert meta_counts("dspark")["host_link"] == {"bytes_per_cycle": 4 * rows, "launches_per_cycle": 1}
    saved = [(g.table, g.table_scale) for g in engrams]
    try:
        for g in engrams:
            g.table = g.table.new_empty((g.table.shape[0] * 100, g.table.shape[1]))
            g.table_scale = g.table_scale.new_empty((g.table_scale.shape[0] * 100, g.table_scale.shape[1]))
        longer = meta_counts()
    finally:
        for g, (table, scale) in zip(engrams, saved):
            g.table, g.table_scale = table, scale
    assert longer["host_link"] == base["host_link"]
    # a count varies by a few routed rows; a table read whole would add 99 tables
    extra = longer["bytes_per_step"]["total"] - base["bytes_per_step"]["total"]
    assert abs(extra) < min(g.table.numel() for g in engrams), extra


@pytest.fixture(scope="module")
def released_config(tmp_path_factory):
    from tests.conftest import DATA

    d = tmp_path_factory.mktemp("v41")
    (d / "config.json").write_text((DATA / "deepseek-v41-flash-config.json").read_text())
    return d


def bench_model(*args) -> dict:
    r = CliRunner().invoke(main, ["bench", "model", *map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_bench_model_names_each_kernels_bound_prices_the_placements_and_sets_the_anchors(released_config, tmp_path):
    """The released V4.1-Flash on 4 x B300 (meta build): every kernel priced at a named bound, both cycles
    beside the anchors; its experts split by their intermediate over the ranks (no rank busier: no imbalance
    term), which the placement pricing finds cheaper than whole experts per rank, the more so with measured
    routing that puts every pick on one rank's experts; the MoE's sum over ranks two rows a token; a malformed
    routing file is refused naming the option and the line."""
    args = ("--model", released_config, "--devices", 4, "--gpu", "b300", "--draft-tokens", 3, "--accepted", 2.5,
            "--context", 4096, "--json")
    report = bench_model(*args)
    plain, verify = report["cycles"]
    for cyc in (plain, verify):
        counted = cyc["prediction"]["counted"]
        assert {k["bound"] for k in counted["kernels"]} <= {"bytes", "issue", "tensor", "host_link"}
        assert counted["terms_s"]["imbalance"] == 0
        assert counted["cycle_s"] == pytest.approx(sum(counted["terms_s"].values()))
        assert cyc["against_anchors"]["vs_vllm_p90"] == pytest.approx(counted["tokens_per_s"] / 826.0)
        assert "launches" not in cyc["count"]
        experts = cyc["placement"]["routed_experts"]
        assert 0 < experts["split_intermediate"] < experts["expert_parallel"]
    # over symmetric memory, a layer's two sums over ranks (the backbone's rows', a DSpark stage's): the
    # attention's output rows, float32; the MoE's rows' pairs' sums and the split shared expert's partial rows
    # (not every pair's partial); an Engram layer's rank's columns of its product (whole blocks of wkv's rows);
    # the rank's columns of the logits a sampler reads in place (the head's rows, each Markov step's one row).
    # No all-gather: DSpark's base logits (the k drafts' rows of its block of five, read by the Markov steps
    # after other exchanges) go through an exchange of their own, each Markov step reading its row's parts
    # where they lie ("symm_read": the peers' parts, no wait of its own).
    from appliance.model.config import load_config

    cfg = load_config(released_config)
    block = cfg.weight_block[0]
    engram = -(-(cfg.hc_mult + 1) * cfg.dim // block // 4) * block
    columns = cfg.vocab_size // 4 * 4
    for cyc, rows, stage in ((plain, 1, None), (verify, 4, 5)):
        payloads = cyc["count"]["collectives"]["payloads"]
        sums = {c["bytes"] for c in payloads if c["op"] == "symm_"}
        want = {n * w * 4 for n in (rows, stage) if n for w in (cfg.dim, 2 * cfg.dim)} | {rows * engram * 4}
        want |= {rows * columns} | ({columns} if stage else set())
        assert sums == want, (sorted(sums), sorted(want))
        others = [(c["op"], c["bytes"], c["count"]) for c in payloads if c["op"] != "symm_"]
        assert others == ([("symm_read", columns, rows - 1)] if stage else []), others
    assert verify["prediction"]["counted"]["cycle_s"] > plain["prediction"]["counted"]["cycle_s"]
    # a decode step's router, gate and up, and down: one launch a layer, its FP4 expert elements counted (what its
    # issue is priced by) and its two waits between phases priced with the launches
    kernels = {k["kernel"]: k for k in plain["prediction"]["counted"]["kernels"]}
    moe = kernels["kernels.moe._step_kernel"]
    assert moe["weights"] > 0 and moe["launches"] == len(plain["count"]["launches_by_layer"])
    apart = {"kernels.moe._gate_up_kernel", "kernels.moe._down_kernel", "kernels.router._router_kernel"}
    assert not apart & set(kernels), sorted(apart & set(kernels))
    routing = tmp_path / "routing.jsonl"
    routing.write_text("".join(json.dumps([[0, 1, 2, 3, 4, 5]]) + "\n" for _ in range(20)))
    lopsided = bench_model(*args, "--routing", routing)["cycles"][0]["placement"]["routed_experts"]
    uniform = plain["placement"]["routed_experts"]
    assert lopsided["expert_parallel"] > uniform["expert_parallel"]
    assert lopsided["split_intermediate"] == pytest.approx(uniform["split_intermediate"])
    routing.write_text('[[0, 1]]\n[[0, 999]]\n')
    r = CliRunner().invoke(main, ["bench", "model", *map(str, args), "--routing", str(routing)])
    assert r.exit_code != 0 and "--routing" in r.output and "line 2" in r.output


def test_a_prefill_chunk_is_priced_by_its_rows_and_its_prompts_time_to_first_token_sums_its_chunks():
    """A chunk's weight products pass over their weights once per 16 rows (issue and FP8 tensor FLOPs in
    proportion), the attention's FLOPs at the bfloat16 peak; a prompt's chunks grow linearly from the first
    counted chunk's time to the last's, and their sum is its time to first token."""
    gpu = cm.GPU("toy", hbm_bytes_per_s=1e12, memory_bytes=1e11, nvlink_bytes_per_s=1e11, source="test",
                 arch=103, issue_per_s=1e12, tensor_flops={"fp8": 2e14, "bf16": 1e14})
    per = cm.ISSUE_PER_ELEMENT[103][("linear", "fp8")]
    rows = int(torch.randint(2, 64, ())) * 16
    elements = int(torch.randint(10**6, 10**7, ()))
    product = _launch("kernels.linear._kernel", bytes_read=elements, weights={"fp8": elements},
                      flops={"products": 2 * rows * elements})
    terms = cm.launch_terms(product, gpu)
    assert terms["issue"] == pytest.approx(rows / 16 * elements * per / 1e12)
    assert terms["tensor"] == pytest.approx(2 * rows * elements / 2e14)
    attention = _launch("kernels.attention._kernel", bytes_read=1000, flops={"attention": 3e12})
    assert cm.launch_terms(attention, gpu)["tensor"] == pytest.approx(3e12 / 1e14)
    # undeclared: one pass, a decode step's 16 rows
    assert cm.launch_terms(dict(product, flops={}), gpu)["issue"] == pytest.approx(elements * per / 1e12)

    def chunk(start, attention_flops):
        return {"start": start, "chunk": 256, "launches_per_chunk": 2, "launches_per_layer": 2, "scratch_bytes": 0,
                "collectives": {"per_cycle": 1, "payloads": [{"op": "allgather_", "bytes": 10**6, "count": 1}]},
                "bytes_per_step": {"total": elements, "written": 0},
                "flops": {"products": 0, "attention": attention_flops},
                "launches": [product, _launch("kernels.attention._kernel", flops={"attention": attention_flops})]}

    first, last = chunk(0, 1e12), chunk(256 * 99, 5e12)
    out = cm.prefill(first, last, gpu, 4, [256, 256 * 50, 256 * 100])
    t0, t1 = out["chunks"][0]["chunk_s"], out["chunks"][256 * 99]["chunk_s"]
    assert t1 - t0 == pytest.approx(4e12 / 1e14)
    for q, n in zip(out["prompts"], (1, 50, 100)):
        assert q["chunks"] == n
        assert q["ttft_s"] == pytest.approx(sum(t0 + (t1 - t0) * j / 99 for j in range(n)))
    assert out["prompts"][-1]["last_chunk_s"] == pytest.approx(t1)
    assert out["chunks"][0]["link_bytes_sent"] == pytest.approx(3 * 10**6)


def test_a_prefill_chunks_products_that_can_run_long_are_priced_per_long_tile_with_their_staging():
    """In a prefill chunk's count (long calls) a launch that declared its long FLOPs passes over its weights
    once per LONG_ROWS rows at the long main loop's issue, and its rows' staging is a launch of its own (its
    bytes and the fixed cost); one that did not (a launch mixing formats) keeps 16 rows a pass; a decode
    cycle's count never runs long."""
    gpu = cm.GPU("toy", hbm_bytes_per_s=1e12, memory_bytes=1e11, nvlink_bytes_per_s=1e11, source="test",
                 arch=103, issue_per_s=1e12, tensor_flops={"fp8": 2e14, "bf16": 1e14})
    long_rate = cm.ISSUE_PER_ELEMENT_LONG[103][("linear", "fp8")]
    short_rate = cm.ISSUE_PER_ELEMENT[103][("linear", "fp8")]
    rows = int(torch.randint(2, 300, ())) * 16
    padded = -(-rows // cm.LONG_ROWS) * cm.LONG_ROWS
    elements, staged = int(torch.randint(10**6, 10**7, ())), int(torch.randint(10**6, 10**8, ()))
    product = _launch("kernels.linear._kernel", bytes_read=elements, weights={"fp8": elements}, staged_bytes=staged,
                      flops={"products": 2 * rows * elements, "products_long": 2 * padded * elements})
    terms = cm.launch_terms(product, gpu, long=True)
    assert terms["issue"] == pytest.approx(padded / cm.LONG_ROWS * elements * long_rate / 1e12)
    assert terms["tensor"] == pytest.approx(2 * padded * elements / 2e14)
    mixed = dict(product, flops={"products": 2 * rows * elements}, staged_bytes=0)
    assert cm.launch_terms(mixed, gpu, long=True)["issue"] == pytest.approx(rows / 16 * elements * short_rate / 1e12)
    assert cm.launch_terms(product, gpu)["issue"] == pytest.approx(rows / 16 * elements * short_rate / 1e12)

    def count(long):
        return {"long_calls": long, "launches": [product, mixed], "bytes_per_step": {"total": 0, "written": 0},
                "collectives": {"per_cycle": 0, "payloads": []}}

    # from registers (wo_a: a plain FP8 product): its own measured loop, long on every GPU, no staging
    plain = dict(product, path="registers", staged_bytes=0)
    for arch in (90, 103):
        g = dataclasses.replace(gpu, arch=arch)
        rates = cm.ISSUE_PER_ELEMENT_REGISTERS_LONG[arch][("linear", "fp8")], cm.ISSUE_PER_ELEMENT_REGISTERS[arch][
            ("linear", "fp8")]
        assert cm.launch_terms(plain, g, long=True)["issue"] == pytest.approx(
            padded / cm.LONG_ROWS * elements * rates[0] / 1e12)
        assert cm.launch_terms(plain, g)["issue"] == pytest.approx(rows / 16 * elements * rates[1] / 1e12)
    # on sm_90 the checkpoint's formats take the e4m3 MMA in programs of 8 rows, 32 in a long call: a pass
    # per 8 (32) at its rate
    h200 = dataclasses.replace(gpu, arch=90)
    padded32 = -(-rows // 32) * 32
    e4m3 = dict(product, flops=dict(product["flops"], products_e4m3=2 * rows * elements,
                                    products_long_e4m3=2 * padded32 * elements))
    assert cm.runs_long(e4m3, h200, True)
    assert cm.launch_terms(e4m3, h200)["issue"] == pytest.approx(
        rows / 8 * elements * cm.ISSUE_PER_ELEMENT[90][("linear", "fp8")] / 1e12)
    assert cm.launch_terms(e4m3, h200, long=True)["issue"] == pytest.approx(
        padded32 / 32 * elements * cm.ISSUE_PER_ELEMENT_LONG[90][("linear", "fp8")] / 1e12)
    prefill, decode = cm.cycle_time(count(True), gpu, 1), cm.cycle_time(count(False), gpu, 1)
    assert prefill["stagings"] == 1 and decode["stagings"] == 0
    fixed = [cm.launch_s(la["kind"], gpu) for la in count(True)["launches"]]
    assert prefill["terms_s"]["launches"] == pytest.approx(sum(fixed) + cm.launch_s("triton", gpu))
    staging = next(k for k in prefill["kernels"] if k["kernel"] == "kernels.rows._stage_kernel")
    assert staging["bytes"] == staged
    assert staging["s"] == pytest.approx(staged / (1e12 * cm.COPY_FRACTION) + cm.launch_s("triton", gpu))


def test_a_counted_prefill_chunk_declares_its_products_and_attention_flops(released_config):
    """On the released V4.1-Flash's meta build (4 ranks): each weight product's FLOPs are 2 x the chunk's
    rows (the attention's output product: the rank's share of them) padded to 16 x its weight elements, the
    attention's 4 x rows x heads x head dim x (window + selected
    rows); a chunk deep in the context scores more index keys and reads more, but sends about as much over
    the links (activations and selections, not scores: the candidate blocks' flags grow, a byte a block)."""
    from appliance.measure.count import count_prefill
    from appliance.measure.shapes import meta_model
    from appliance.model.config import load_config

    model = meta_model(load_config(released_config), "bfloat16", drafter=False, world=4, experts="auto").model
    state = model.new_state(8192, device="meta")
    rows = int(torch.randint(17, 48, ()))
    early, late = count_prefill(model, state, 0, rows), count_prefill(model, state, 8192 - rows, rows)
    products = [la for la in early["launches"] if la["name"] == "kernels.linear._kernel" and la["weights"]]
    # rank 0's share of the rows: the attention's output product, taken whole for them (one launch a layer)
    share = -(-rows // 4)
    mine = [la for la in products if la["flops"]["products"] == 2 * -(-share // 16) * 16 * sum(la["weights"].values())]
    assert len(mine) == len(model.layers)

    def rows_of(la) -> int:
        return share if la in mine else rows

    assert products and all(la["flops"]["products"] == 2 * -(-rows_of(la) // 16) * 16 * sum(la["weights"].values())
                            for la in products)
    # as a long call's: LONG_ROWS a pass, in the checkpoint's formats with a staging of the rows, from
    # registers without (wo_a, a plain product); the attention's first launch, FP8 products beside dense
    # ones, two launches (the count sees weights in the FP8 one)
    assert early["long_calls"]
    longs = [la for la in products if "products_long" in la["flops"]]
    assert longs == products
    assert all(la["flops"]["products_long"] == 2 * cm.LONG_ROWS * sum(la["weights"].values()) for la in longs)
    assert all((la["staged_bytes"] > 0) == (la["path"] == "native") for la in longs)
    assert all(la["flops"]["products_e4m3"] == 2 * -(-rows_of(la) // 8) * 8 * sum(la["weights"].values())
               and la["flops"]["products_long_e4m3"] == 2 * -(-rows_of(la) // 32) * 32 * sum(la["weights"].values())
               for la in products if la["path"] == "native")
    assert {la["path"] for la in longs} == {"native", "registers"}
    experts = [la for la in early["launches"] if "kernels.moe" in la["name"] and la["weights"]]
    assert experts and all(la["staged_bytes"] > 0 and "products_long" in la["flops"] for la in experts)
    attends = [la for la in early["launches"] if "attention" in la["flops"]]
    assert attends and early["flops"]["attention"] > 0
    assert late["flops"]["attention"] > early["flops"]["attention"]
    assert late["bytes_per_step"]["total"] > early["bytes_per_step"]["total"]
    assert 0 < early["collective_bytes"] <= late["collective_bytes"] < 1.1 * early["collective_bytes"]
    assert early["host_syncs"] == 0
    # the MoE's pairs' sums (the first combine of a layer's MoE) write the rows they send: a row of the
    # model's width in float32 each, none of it read
    layer = [la for la in early["launches"] if la["block"] == "layer 3"]
    sums = next(la for la in layer if la["name"] == "kernels.moe._combine_kernel")
    pairs = rows * 6  # top-6 of V4.1-Flash's experts: their outputs in bfloat16, their positions int64
    assert (sums["bytes_written"], sums["bytes_read"]) == (rows * 5120 * 4, pairs * 5120 * 2 + pairs * 8), sums


def test_bench_model_prices_a_prompts_prefill_against_its_goal(released_config):
    """`bench model --prefill`: the time to first token of 32K, 128K and 855K prompts (and --context's), from
    two chunks counted at the start and the end of the longest, each under the same terms as a cycle."""
    report = bench_model("--model", released_config, "--devices", 4, "--gpu", "b300", "--prefill", "--chunk", 256,
                         "--context", 65536, "--json")
    p = report["prefill"]
    assert [q["prompt"] for q in p["prompts"]] == [32768, 65536, 131072, 855000]
    assert sorted(int(start) for start in p["chunks"]) == [0, (-(-855000 // 256) - 1) * 256]
    times = [q["ttft_s"] for q in p["prompts"]]
    assert times == sorted(times) and times[0] > 0
    for c in p["chunks"].values():
        assert c["chunk_s"] == pytest.approx(sum(c["terms_s"].values()))
    assert report["anchors"]["goal_855k_ttft_s"] == 8.0
    assert report["link_floor_bytes"] > 0


def test_the_prefill_link_floor_is_what_a_tokens_dispatch_to_its_experts_ranks_sends_at_least():
    """costmodel.dispatch_floor_bytes against a simulation of uniform routing: a token's home on one of the
    ranks holding its experts, its row out to each other such rank in FP8 and their output back in bfloat16."""
    world, layers = int(torch.randint(2, 9, ())), int(torch.randint(1, 60, ()))
    e = world * int(torch.randint(2, 64, ()))
    k = int(torch.randint(1, min(e, 12), ()))
    cfg = argparse.Namespace(n_routed_experts=e, n_activated_experts=k, dim=16 * int(torch.randint(8, 512, ())),
                             act_block=32 << int(torch.randint(0, 3, ())), n_layers=layers)
    rows = 16 * int(torch.randint(1, 1024, ()))
    picked = torch.rand(20000, e).topk(k, dim=-1).indices // (e // world)  # each token's experts' ranks
    remote = torch.stack([(picked == r).any(-1) for r in range(world)], -1).sum(-1).double().mean().item() - 1
    row = cfg.dim + cfg.dim * 4 / cfg.act_block + 2 * cfg.dim
    per_remote = rows / world * row * layers  # (k = 1: no rank but the home, up to a rounding of the count)
    floor = cm.dispatch_floor_bytes(cfg, rows, world)
    assert floor == pytest.approx(per_remote * remote, rel=0.03, abs=per_remote * 1e-9)
    assert cm.dispatch_floor_bytes(cfg, rows, 1) == 0


def test_bench_prefill_prints_each_chunks_time_beside_its_count_and_the_models_price():
    """`bench prefill`: every chunk timed; the first and the last counted on the meta build (the counts `bench
    model --prefill` prices) beside their measured time, priced on --gpu's constants."""
    from appliance.cli.bench import GPU_KINDS

    assert set(GPU_KINDS) == set(cm.GPUS)
    r = CliRunner().invoke(main, ["bench", "prefill", "--tokens", "40", "--chunk", "16", "--path", "fast",
                                  "--gpu", "h200", "--json"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output.strip().splitlines()[-1])
    assert [(c["start"], c["rows"]) for c in row["chunks"]] == [(0, 16), (16, 16), (32, 8)]
    assert all(c["ms"] > 0 for c in row["chunks"]) and row["gpu"] == "h200"
    first, last = row["counted"]
    assert (first["start"], first["rows"], last["start"], last["rows"]) == (0, 16, 32, 8)
    assert first["measured_ms"] == row["chunks"][0]["ms"] and last["measured_ms"] == row["chunks"][-1]["ms"]
    for c in row["counted"]:
        assert c["launches"] > 0 and c["bytes_read"] > 0 and c["scratch_bytes"] > 0 and c["modeled_ms"] > 0
    assert first["flops"]["products"] > last["flops"]["products"]  # 16 rows against 8
    r = CliRunner().invoke(main, ["bench", "prefill", "--tokens", "0"])
    assert r.exit_code == 2 and "--tokens" in r.output


def test_a_selected_experts_rows_are_padded_to_whole_tiles_in_expectation():
    """The rows a selected expert's products compute: its pairs padded to whole tiles, in expectation under
    uniform routing (binomial pairs) as simulated calls measure them; a decode row's expert pads to one tile,
    and where the mean share sits at a tile's edge half the experts take a second tile."""
    from appliance.measure.tiles import expected_tile_rows, tile_rows

    assert expected_tile_rows(384, 6, 1, 16) == pytest.approx(16)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    rows, tile = 2048, 32  # 32 pairs an expert on average: the tile's edge
    calls = [torch.rand(rows, 384, generator=g).topk(6, -1).indices for _ in range(16)]
    measured = sum(tile_rows(ids, [True] * 384, tile) for ids in calls) / len(calls)
    expected = expected_tile_rows(384, 6, rows, tile)
    assert expected == pytest.approx(measured, rel=0.02)
    assert 1.3 * tile < expected < 1.7 * tile
    assert tile_rows(calls[0], [e % 2 == 0 for e in range(384)], tile) == pytest.approx(measured, rel=0.1)
