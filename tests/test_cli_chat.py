"""`appliance chat encode | parse`: the prompt of a request file, its ids through a tokenizer that holds
DeepSeek's special tokens (built here, small), the parsed output as JSON, and one line + exit 2 for bad
input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.chat.dialects import DIALECTS
from appliance.cli.chat import chat

DATA = Path(__file__).parent / "data" / "chat"
REQUESTS = json.loads((DATA / "request_examples.json").read_text())
PARSE = json.loads((DATA / "parse_examples.json").read_text())


def invoke(*args):
    return CliRunner().invoke(chat, [str(a) for a in args])


def assert_one_line_error(result, needle):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("appliance: error: ") and needle in lines[0], result.stderr


def write_tokenizer(directory: Path, specials: dict[str, int]) -> Path:
    """A byte-level BPE without merges whose added tokens sit at the given ids (DeepSeek's are sparse)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: 1000 + i for i, c in enumerate(alphabet)} | specials
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("case", REQUESTS[:4] + REQUESTS[-4:], ids=lambda c: f"{c['example']}-{c['dialect']}")
def test_encode_prints_the_exact_prompt_of_a_request_file(case, tmp_path):
    (tmp_path / "req.json").write_text(json.dumps(case["request"]))
    result = invoke("encode", "--family", case["dialect"], "--request", tmp_path / "req.json")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == case["prompt"]


def test_encode_json_gives_ids_with_each_special_token_as_its_single_id(tmp_path):
    dialect = DIALECTS["deepseek_v41"]
    model = write_tokenizer(tmp_path / "m", dialect.special_tokens)
    case = next(c for c in REQUESTS if c["example"] == "9a")
    (tmp_path / "req.json").write_text(json.dumps(case["request"]))
    result = invoke("encode", "--family", "deepseek_v41", "--request", tmp_path / "req.json", "--json",
                    "--model", model)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["prompt"] == case["prompt"] and out["thinking"] is True
    ids = out["ids"]
    assert ids[:2] == [0, 128799] and ids[-2:] == [128804, 128821]
    for token in ("<｜User｜>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>"):
        assert ids.count(dialect.special_tokens[token]) == case["prompt"].count(token), token
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(model / "tokenizer.json")).decode(ids, skip_special_tokens=False) == out["prompt"]


def test_encode_json_without_a_model_prints_the_prompt_and_no_ids(tmp_path):
    (tmp_path / "req.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "thinking": False}))
    result = invoke("encode", "--family", "deepseek_v4", "--request", tmp_path / "req.json", "--json")
    assert json.loads(result.stdout) == {"prompt": "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>",
                                         "thinking": False, "ids": None}


def test_a_tokenizer_without_deepseeks_special_tokens_is_refused(tmp_path):
    (tmp_path / "req.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    wrong = write_tokenizer(tmp_path / "wrong", {**DIALECTS["deepseek_v4"].special_tokens, "<｜User｜>": 5})
    bare = write_tokenizer(tmp_path / "bare", {})
    for model, needle in ((wrong, "single id 128803"), (bare, "<｜begin▁of▁sentence｜>"),
                          (tmp_path, "no tokenizer.json"), (tmp_path / "nope", "no such directory")):
        assert_one_line_error(invoke("encode", "--family", "deepseek_v4", "--request", tmp_path / "req.json",
                                     "--json", "--model", model), needle)


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("{not json", "not a JSON file"),
    ('["a list"]', "request body must be a JSON object"),
    ('{"messages": []}', "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]},
                 {"role": "user", "content": "q"}]}), "messages[1].tool_calls[0].function.arguments"),
    ('{"messages": [{"role": "user", "content": "q"}], "reasoning_effort": 500}', "reasoning_effort=500"),
])
def test_a_bad_request_file_is_one_line_and_exit_2(tmp_path, content, needle):
    path = tmp_path / "req.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(invoke("encode", "--family", "deepseek_v41", "--request", path), needle)


@pytest.mark.parametrize("case", [c for c in PARSE if c["example"] in ("6", "7", "10a", "6 on V4.1")],
                         ids=lambda c: c["example"])
def test_parse_json_prints_content_reasoning_and_openai_tool_calls(case, tmp_path):
    (tmp_path / "out.txt").write_bytes(case["text"].encode())
    result = invoke("parse", "--family", case["dialects"][0], "--thinking", "on" if case["thinking"] else "off",
                    "--text", tmp_path / "out.txt", "--json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    want = case["expected"]
    assert (out["content"], out["reasoning_content"], out["finish_reason"]) == \
        (want["content"], want["reasoning_content"], want["finish_reason"])
    assert [{"type": c["type"], "function": c["function"]} for c in out["tool_calls"]] == want["tool_calls"]
    assert all(c["id"].startswith("call_") for c in out["tool_calls"])
    assert (out["malformed_tool_call"] is not None) == want["malformed"]


def test_parse_without_json_prints_a_readable_summary_and_a_missing_file_is_exit_2(tmp_path):
    (tmp_path / "out.txt").write_text("Hmm.</think>Yes." + "<｜end▁of▁sentence｜>")
    result = invoke("parse", "--family", "deepseek_v41", "--text", tmp_path / "out.txt")
    assert result.stdout == "reasoning: Hmm.\ncontent: Yes.\nfinish: stop\n"
    assert_one_line_error(invoke("parse", "--family", "deepseek_v41", "--text", tmp_path / "nope.txt"), "nope.txt")


def test_the_appliance_command_runs_chat_encode_and_exits_2_on_a_bad_file(tmp_path):
    (tmp_path / "req.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    run = [sys.executable, "-m", "appliance", "chat", "encode", "--family", "deepseek_v41"]
    good = subprocess.run([*run, "--request", str(tmp_path / "req.json")], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and good.stdout.endswith("<｜User｜>Hi<｜Assistant｜><think>"), good.stderr
    bad = subprocess.run([*run, "--request", str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == \
        [f"appliance: error: --request {tmp_path / 'none.json'}: no such file"]
