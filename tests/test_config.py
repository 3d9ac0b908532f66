"""Config parsing: both DeepSeek-V4 spellings, V4.1's nested and flat forms, and errors that name the
field and the file."""

import json

import pytest

from appliance.errors import ConfigError
from appliance.model.config import V4Config, V41Config, load_config, parse_config

from .conftest import DATA, FIXTURE


def test_released_v41_config_nests_the_text_model_and_keeps_vision_as_a_flag():
    cfg = parse_config(json.loads((DATA / "deepseek-v41-flash-config.json").read_text()))
    assert isinstance(cfg, V41Config)
    assert (cfg.dim, cfg.n_layers, cfg.head_dim, cfg.rope_head_dim, cfg.q_lora_rank) == (5120, 40, 512, 64, 1280)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert cfg.kv_source_of(13) == 8 and cfg.index_source_of(27) == 24 and cfg.kv_source_of(27) == 20
    assert cfg.weight_block == (32, 32) and cfg.act_block == 32 and cfg.expert_dtype == "fp4"
    assert cfg.dspark.target_layer_ids == (37, 38, 39) and cfg.dspark.n_routed_experts == 128
    assert cfg.has_vision and cfg.image_token_id == 129264 and cfg.norm_eps == 1e-20


def test_flat_reference_config_of_the_fixture_parses_to_the_same_kind_of_config():
    cfg = load_config(FIXTURE)
    assert isinstance(cfg, V41Config)
    assert cfg.kv_source_layers == (2, 4, 6) and cfg.candidate_source_layer == 6
    assert cfg.engram.num_embeddings == (462, 630) and cfg.dspark.noise_token_id == 1000


def test_v4_official_and_transformers_spellings_give_the_same_config():
    official = json.loads((DATA / "deepseek-v4-flash-config.json").read_text())
    a = parse_config(official)
    hf = {k: v for k, v in official.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                        "rope_scaling")}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hf["layer_types"] = [kinds[r] for r in official["compress_ratios"][:43]]
    hf["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    hf["partial_rotary_factor"] = 0.125
    hf["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                             "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                          "original_max_position_embeddings": 65536, "beta_fast": 32,
                                          "beta_slow": 1}}
    b = parse_config(hf)
    assert isinstance(a, V4Config) and isinstance(b, V4Config)
    for field in ("compress_ratios", "layer_kinds", "n_hash_layers", "rope_head_dim", "rope_factor",
                  "compress_rope_theta", "original_seq_len", "beta_fast"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.layer_kinds[2:4] == ("csa", "hca") and a.n_hash_layers == 3


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(model_type="llama"), "model_type"),
    (lambda d: d.pop("hidden_size"), "hidden_size"),
    (lambda d: d.update(num_attention_heads="sixty-four"), "num_attention_heads"),
    (lambda d: d.update(compress_ratios=[0, 4]), "compress_ratios"),
    (lambda d: d.update(o_groups=7), "o_groups"),
    (lambda d: d.update(scoring_func="tanh"), "scoring_func"),
])
def test_bad_configs_name_the_field_and_the_file(tmp_path, edit, field):
    data = json.loads((DATA / "deepseek-v4-flash-config.json").read_text())
    edit(data)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert field in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_v41_layer_roles_must_be_consistent(tmp_path):
    data = json.loads((DATA / "deepseek-v41-flash-config.json").read_text())
    data["text_config"]["kv_source_layer_ids"] = [2, 8, 14]  # layer 20 (ratio 1) would read a ratio-2 source
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="compress_ratios"):
        load_config(tmp_path)


def test_a_directory_without_config_json_is_not_a_model(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)
