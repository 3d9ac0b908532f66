"""The command line: each bad input gives one line on stderr naming the problem and exit code 2; the
commands that succeed write what they promise."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import load

APPLIANCE = [sys.executable, "-m", "appliance"]


def run(*args, timeout=120):
    return subprocess.run([*APPLIANCE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(p, needle):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert needle in lines[0], lines[0]


def test_a_missing_model_directory_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(run("generate", "--model", tmp_path / "nope", "--prompt", "hi"), "no such directory")


def test_a_directory_that_is_not_a_model_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(run("generate", "--model", tmp_path, "--prompt", "hi"), "config.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has GPUs to name")
@pytest.mark.parametrize("devices", ["0,1,2,3", "cuda", "3"])
def test_gpus_on_a_machine_without_cuda_are_one_line_and_exit_2_before_any_rank_starts(devices):
    p = run("generate", "--devices", devices, "--prompt", "hi")
    assert_one_line_error(p, f"--devices {devices}: ")
    assert "CUDA" in p.stderr and "started rank" not in p.stderr


def test_ids_outside_the_vocabulary_are_one_line_and_exit_2(tiny_dirs, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([1, 2, 99999]))
    assert_one_line_error(run("generate", "--model", tiny_dirs["deepseek_v4"], "--ids", ids), "vocabulary")
    assert_one_line_error(run("score", "--model", tiny_dirs["deepseek_v4"], "--ids", ids, "--out",
                              tmp_path / "o.safetensors"), "vocabulary")


def test_a_prompt_longer_than_the_maximum_context_is_one_line_and_exit_2(tiny_dirs, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([5] * 5000))  # the tiny models allow 4096 positions
    assert_one_line_error(run("generate", "--model", tiny_dirs["deepseek_v41"], "--ids", ids), "context")
    assert_one_line_error(run("score", "--model", tiny_dirs["deepseek_v41"], "--ids", ids, "--out",
                              tmp_path / "o.safetensors"), "context")


def test_score_writes_teacher_forced_float32_logits(tiny_dirs, tmp_path):

    ids = torch.randint(0, 512, (23,)).tolist()
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    out = tmp_path / "logits.safetensors"
    p = run("score", "--model", tiny_dirs["deepseek_v41"], "--ids", tmp_path / "ids.json", "--out", out,
            "--dump", "engram_ids,index_topk,main_hidden")
    assert p.returncode == 0, p.stderr
    t = load_file(str(out))
    lm = load(tiny_dirs["deepseek_v41"])
    want = lm.model.forward(torch.tensor(ids), lm.model.new_state(64)).logits
    assert t["logits"].dtype == torch.float32 and torch.equal(t["logits"], want)
    assert t["engram_hash_ids"].shape == (23, 2, 6)
    assert t["prefill_index_topk_layer2"].shape == (23, 8) and t["prefill_index_topk_layer2"][0, 0] == -1
    assert t["prefill_main_hidden"].shape == (23, 3 * 64)
    # in forwards of 7: the same logits, each row's kept positions the same (earlier forwards saw fewer rows:
    # their lists are padded with -1)
    p = run("score", "--model", tiny_dirs["deepseek_v41"], "--ids", tmp_path / "ids.json", "--out", out,
            "--dump", "index_topk", "--split", 7)
    assert p.returncode == 0, p.stderr
    split = load_file(str(out))
    assert torch.equal(split["logits"], want)
    whole, parts = t["prefill_index_topk_layer2"], split["prefill_index_topk_layer2"]
    assert parts.shape[0] == 23
    for a, b in zip(whole, parts, strict=True):
        assert sorted(a[a >= 0].tolist()) == sorted(b[b >= 0].tolist())


def test_generate_json_reports_ids_text_usage_and_timings(tiny_dirs):
    p = run("generate", "--model", tiny_dirs["deepseek_v41"], "--prompt", "The quick brown fox", "--max-tokens", 7,
            "--ignore-eos", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["ids"]) == 7 and out["usage"]["completion_tokens"] == 7
    assert out["usage"]["prompt_tokens"] > 0 and isinstance(out["text"], str)
    assert set(out["timings"]) >= {"prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "e2e_ms"}


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_tiny_writes_a_checkpoint_every_command_can_use(tmp_path, family):
    p = run("tiny", tmp_path / "m", "--family", family, "--seed", 3)
    assert p.returncode == 0, p.stderr
    p = run("info", "--model", tmp_path / "m", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["config"]["family"] == family and report["weights"]["total"] > 0


def test_the_embedded_default_model_is_what_appliance_tiny_writes_with_seed_0(tmp_path):
    from appliance.cli.tiny_checkpoint import write_tiny
    from appliance.loader import default_model_dir

    write_tiny(tmp_path, "deepseek_v41", seed=0)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / f).read_bytes() == (default_model_dir() / f).read_bytes(), f
