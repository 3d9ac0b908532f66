"""The cycle recorder and the counts built on it (appliance/measure/recorder.py, count.py): what is a launch,
a host sync, a byte read; one decode cycle counted on the meta device; the cost model's arithmetic."""

import dataclasses

import pytest
import torch

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
    def with_extra_site_launch(ops):
        def hc_pre(X, *args):
            return ops.hc_pre(X.clone(), *args)
        return dataclasses.replace(ops, hc_pre=hc_pre)

    base, more = meta_counts(), meta_counts(ops=with_extra_site_launch)
    grown = [b - a for a, b in zip(base["launches_by_layer"], more["launches_by_layer"])]
    assert all(g == 2 for g in grown)  # the attention's and the MoE's site, in every layer
    assert more["launches_per_cycle"] == base["launches_per_cycle"] + sum(grown) + (
        more["launches_outside_layers"] - base["launches_outside_layers"])


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

    mm = meta_model(load_config(default_model_dir()), world=4, drafter=False)
    session = DecodeSession(mm, RunOptions(path="fast", dtype="bfloat16"), capacity=40, reach_floor=40)
    c = count_cycle(session, 16, world=4)
    assert c["collectives"]["per_layer"] >= 2  # the output projection's and the MoE's reductions
    assert c["host_syncs_per_cycle"] == 0 and c["capture_violations"] == []  # the MoE's fused kernels too
    single = meta_model(load_config(default_model_dir()), drafter=False)
    one = count_cycle(DecodeSession(single, RunOptions(path="fast", dtype="bfloat16"), capacity=40,
                                    reach_floor=40), 16)
    assert c["bytes_per_step"]["ideal"] < one["bytes_per_step"]["ideal"]


def test_the_cost_model_adds_bytes_launches_collectives_and_the_host_link():
    gpu = cm.GPU("toy", hbm_bytes_per_s=1e12, memory_bytes=1e11, nvlink_bytes_per_s=1e11, source="test")
    count = {"bytes_per_step": {"total": 720_000_000, "ideal": 360_000_000}, "launches_per_cycle": 1000,
             "launches_by_layer": [40, 40], "launches_outside_layers": 20, "width": 1,
             "collectives": {"payloads": [{"op": "allreduce_", "bytes": 1_000_000, "count": 10}]},
             "host_link": {"bytes_per_cycle": 20_000, "launches_per_cycle": 1}}
    t = cm.cycle_time(count, gpu, world=4)["terms_s"]
    assert t["bytes"] == pytest.approx((720e6 - 20e3) / (1e12 * cm.COPY_FRACTION * cm.KERNEL_FRACTION))
    assert t["host_link"] == pytest.approx(cm.HOST_READ_LATENCY_S + 20e3 / gpu.host_link_bytes_per_s)
    assert t["launches"] == pytest.approx(1000 * cm.LAUNCH_S)
    assert t["collectives"] == pytest.approx(10 * (cm.ALLREDUCE_LATENCY_S + 1e6 * 2 * 3 / 4 / 1e11))
    p = cm.predict(count, gpu, world=4, tokens_per_cycle=3.5)
    assert p["counted"]["tokens_per_s"] == pytest.approx(3.5 / p["counted"]["cycle_s"])
    budget = p["ideal_bytes_and_launch_budget"]["terms_s"]["launches"]
    assert budget == pytest.approx((16 * 2 + 20) * cm.LAUNCH_S)
    assert cm.cycle_time(count, gpu, world=1)["terms_s"]["collectives"] == 0


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
