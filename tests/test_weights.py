"""Checkpoint loading: transformers' names through the mapping table, stacked experts, and one error that
lists every missing, unexpected and mis-shaped tensor."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.errors import WeightsError
from appliance.loader import load_model
from appliance.model.weights import Checkpoint, official_name
from appliance.options import RunOptions


@pytest.mark.parametrize("stored, official", [
    ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),  # save_pretrained's reverse mapping
    ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("model.layers.3.self_attn.compressor.indexer.kv_proj.weight", "layers.3.attn.indexer.compressor.wkv.weight"),
    ("model.layers.3.self_attn.compressor.indexer.q_b_proj.weight", "layers.3.attn.indexer.wq_b.weight"),
    ("model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.3.attn.indexer.weights_proj.weight"),
    ("model.layers.3.self_attn.compressor.position_bias", "layers.3.attn.compressor.ape"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "layers.3.ffn.gate.bias"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", "layers.3.ffn.shared_experts.w2.weight"),
    ("model.layers.3.attn_hc.fn", "layers.3.hc_attn_fn"),
    ("model.layers.3.input_layernorm.weight", "layers.3.attn_norm.weight"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.layers.3.self_attn.wq_b.weight_scale_inv", "layers.3.attn.wq_b.scale"),
    ("layers.3.attn.wq_b.weight", "layers.3.attn.wq_b.weight"),
])
def test_transformers_names_map_to_official_names(stored, official):
    assert official_name(stored) == official


def test_stacked_experts_are_sliced_into_official_per_expert_weights(tmp_path):
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 5, 7, generator=g)
    down = torch.randn(3, 7, 5, generator=g)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down},
              str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path)
    for e in range(3):
        assert torch.equal(ck.read(f"layers.0.ffn.experts.{e}.w1.weight"), gate_up[e, :5])
        assert torch.equal(ck.read(f"layers.0.ffn.experts.{e}.w3.weight"), gate_up[e, 5:])
        assert torch.equal(ck.read(f"layers.0.ffn.experts.{e}.w2.weight"), down[e])


def test_one_error_lists_every_missing_unexpected_and_misshaped_tensor(tiny_dirs, tmp_path):
    src = tiny_dirs["deepseek_v41"]
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(src / f, tmp_path / f)
    t = load_file(str(src / "model.safetensors"))
    del t["layers.0.attn.wq_a.weight"]  # missing
    del t["layers.5.ffn.experts.3.w2.scale"]  # missing scale
    t["layers.1.attn_norm.weight"] = torch.ones(65, dtype=torch.bfloat16)  # mis-shaped
    t["layers.99.surprise"] = torch.zeros(2)  # unexpected
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError) as e:
        load_model(RunOptions(model_dir=tmp_path), notice=None)
    msg = str(e.value)
    for needle in ("missing layers.0.attn.wq_a.weight", "missing layers.5.ffn.experts.3.w2.scale",
                   "mis-shaped layers.1.attn_norm.weight", "unexpected layers.99.surprise", "4 checkpoint problem"):
        assert needle in msg, needle


def test_sharded_checkpoints_load_through_their_index(tiny_dirs, tmp_path):
    import json

    src = tiny_dirs["deepseek_v4"]
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(src / f, tmp_path / f)
    t = load_file(str(src / "model.safetensors"))
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(RunOptions(model_dir=src), notice=None)
    b = load_model(RunOptions(model_dir=tmp_path), notice=None)
    ids = torch.randint(0, a.cfg.vocab_size, (9,))
    assert torch.equal(a.model.forward(ids, a.model.new_state(16)).logits,
                       b.model.forward(ids, b.model.new_state(16)).logits)
