"""`appliance info`'s weights and state read off a meta build (appliance/measure/sizes.py): what a rank holds
is what the split leaves it, where a table lives is placement's decision, and the plan agrees."""

import pytest

from appliance.loader import default_model_dir
from appliance.measure import sizes
from appliance.measure.memory import fast_path_plan
from appliance.measure.shapes import meta_model, rank_shares
from appliance.model.config import load_config


@pytest.fixture(scope="module")
def cfg():
    return load_config(default_model_dir())


def test_a_ranks_weights_are_the_memory_plans_weights(cfg):
    plan = fast_path_plan(cfg, 4096, 141 * 10**9, world=4)
    assert sizes.rank_weights(meta_model(cfg, world=4))["total"] == plan.parts["weights"]


def test_a_rank_holds_a_share_of_the_query_heads_and_their_sinks_and_all_of_the_indexer(cfg):
    shares = rank_shares(meta_model(cfg), 4)
    a = f"layers.{cfg.index_source_of(cfg.n_layers - 1)}.attn"  # a layer with an indexer
    assert shares[f"{a}.wq_b.weight"] == shares[f"{a}.attn_sink"] == shares[f"{a}.wo_a.weight"] == 0.25
    assert shares[f"{a}.indexer.wq_b.weight"] == shares[f"{a}.wkv.weight"] == 1.0
    assert shares[f"{a}.q_norm.weight"] == 1.0  # held only as a float32 copy: replicated


def test_engram_tables_live_where_placement_puts_them(cfg, monkeypatch):
    from appliance.parallel import placement

    assert "host" not in sizes.weight_bytes(meta_model(cfg))["by_where"]  # the tiny tables: on the device
    monkeypatch.setattr(placement, "HOST_TABLE_BYTES", 0)
    w = sizes.weight_bytes(meta_model(cfg))
    assert 0 < w["by_where"]["host"] < w["by_part"]["engram"]  # the tables, not Engram's projections
