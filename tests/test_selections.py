"""The model's choices recorded from outside (appliance/measure/selections.py): one record per choosing call,
the forward's result unchanged, and nothing left on the model after the context."""

import pytest
import torch

from appliance.measure.selections import engram_ids, index_topk, routed_experts

from .conftest import load


@pytest.mark.parametrize("name", ["deepseek_v41", "deepseek_v4"])
def test_a_recorded_forward_gives_each_choice_once_and_the_same_logits(name, tiny_dirs):
    model = load(tiny_dirs[name]).model
    tokens = torch.arange(3, 23)
    plain = model.forward(tokens, model.new_state(32)).logits
    ops = model.rt.ops
    with index_topk(model) as kept, engram_ids(model) as ids, routed_experts(model) as experts:
        recorded = model.forward(tokens, model.new_state(32)).logits
    assert torch.equal(recorded, plain)
    assert kept and all(len(rows) == 1 and rows[0].shape[0] == 20 for rows in kept.values()), kept.keys()
    assert [e.shape for e in experts] == [(20, model.cfg.n_activated_experts)] * model.cfg.n_layers
    assert len(ids) == (1 if name == "deepseek_v41" else 0)
    assert model.rt.ops is ops
    assert not any("select_rows" in vars(layer.attn) for layer in model.layers)
    hashing = getattr(model, "engram_hash", None)
    assert hashing is None or "lookup" not in vars(hashing)
