"""Chat requests engine-side: the tiny checkpoints tokenize DeepSeek's special tokens as single ids, the
request loop sends the dialect's prompt and turns the model's output into answer, reasoning and tool calls
(never markup), sampling defaults come from generation_config.json or the model card, and decode.v1 frames
of prompt and ids requests are unchanged."""

import json
import random

import pytest

from appliance.api import ChatRequest, Done, Error, Request, Sampling, Tokens
from appliance.chat import DIALECTS, encode_request, sampling_defaults
from appliance.chat.dialects import ASSISTANT, BOS, DSML, EOS, HIDDEN_TOKENS, THINK_CLOSE, THINK_OPEN, USER
from appliance.errors import ModelLoadError
from appliance.loader import default_model_dir
from appliance.model.tokenizer import load_tokenizer
from server import protocol as proto
from tests.scripted_engine import scripted_engine

rng = random.Random()


@pytest.fixture(scope="module")
def scripted():
    engine, session = scripted_engine()
    yield engine, session
    engine.close()


def test_the_embedded_tokenizer_reads_each_deepseek_special_token_as_one_id_and_bos_eos_at_0_and_1():
    tok = load_tokenizer(default_model_dir())
    assert tok.encode(BOS) == [0] and tok.encode(EOS) == [1]
    for t in (USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML, *HIDDEN_TOKENS):
        ids = tok.encode(t)
        assert len(ids) == 1 and tok.decode(ids) == t, t
    text = f"{USER}{''.join(rng.choice('abcxyz ') for _ in range(12))}{ASSISTANT}{THINK_OPEN}"
    assert tok.decode(tok.encode(text)) == text


def test_a_chat_request_gets_the_dialects_prompt_and_its_output_comes_back_split_without_markup(scripted):
    engine, session = scripted
    thought, answer, city = "ponder " * rng.randint(1, 3), "answer " * rng.randint(1, 3), rng.choice("ABC")
    session.script(f"{thought}</think>{answer}\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"w\">\n"
                   f"<｜DSML｜ parameter name=\"c\" string=\"true\">{city}</｜DSML｜ parameter>\n"
                   f"</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    tools = [{"type": "function", "function": {"name": "w", "parameters": {}}}]
    messages = [{"role": "user", "content": "weather?"}]
    chat = ChatRequest(messages, tools=tools)
    events = list(engine.generate(Request(id="c", chat=chat, max_tokens=600)))
    expected = encode_request(chat, DIALECTS["deepseek_v41"]).text
    assert session.prompt_text() == expected
    tokens = [e for e in events if isinstance(e, Tokens)]
    assert "".join(t.reasoning for t in tokens) == thought and "".join(t.text for t in tokens) == answer
    calls = [c for t in tokens for c in t.tool_calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("w", {"c": city})]
    shown = "".join(t.text + t.reasoning for t in tokens)
    assert DSML not in shown and "</think>" not in shown and "invoke" not in shown
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"


def test_a_chat_request_samples_as_the_checkpoint_recommends_and_a_prompt_request_stays_greedy(scripted):
    engine, session = scripted
    session.script("x")
    list(engine.generate(Request(id="a", chat=ChatRequest([{"role": "user", "content": "hi"}]),
                                 sampling=Sampling(temperature=None, top_p=None))))
    assert (session.samplings[-1].temperature, session.samplings[-1].top_p) == (1.0, 1.0)  # the model card
    session.script("y")
    list(engine.generate(Request(id="b", prompt="hi")))
    assert (session.samplings[-1].temperature, session.samplings[-1].top_p) == (0.0, 1.0)


def test_a_dialect_error_names_the_field_before_any_output(scripted):
    engine, _ = scripted
    chat = ChatRequest([{"role": "user", "content": "hi"}], reasoning_effort=500)
    events = list(engine.generate(Request(id="e", chat=chat)))
    assert len(events) == 1 and isinstance(events[0], Error) and events[0].param == "reasoning_effort"


def test_generation_config_sets_the_defaults_and_a_bad_value_is_a_load_error_naming_it(tmp_path):
    v41 = DIALECTS["deepseek_v41"]
    assert sampling_defaults(tmp_path, v41) == {"temperature": 1.0, "top_p": 1.0, "source": "model card"}
    t = round(rng.uniform(0.1, 1.5), 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": t, "do_sample": True}))
    assert sampling_defaults(tmp_path, v41) == {"temperature": t, "top_p": 1.0, "source": "generation_config.json"}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ModelLoadError) as e:
        sampling_defaults(tmp_path, v41)
    assert e.value.field == "top_p"


def test_a_prompt_requests_delta_frame_is_unchanged_and_a_chat_delta_carries_reasoning_and_calls():
    plain = proto.delta([Tokens("r", [5, 6], "ab", 0, [1.0, 2.0])], "final")
    assert plain == {"type": "delta", "id": "r", "index": 0, "text": "ab", "token_ids": [5, 6]}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = proto.delta([Tokens("r", [5], "", 0, [1.0], "why"), Tokens("r", [6], "so", 1, [2.0], "", [call])], "final")
    assert chat["text"] == "so" and chat["reasoning"] == "why" and chat["tool_calls"] == [call]


def test_max_tokens_has_no_cap_but_the_context(scripted):
    engine, session = scripted
    session.script("z")
    events = list(engine.generate(Request(id="m", prompt="hi", max_tokens=4000)))
    assert isinstance(events[-1], Done)
    events = list(engine.generate(Request(id="n", prompt="hi", max_tokens=5000)))
    assert isinstance(events[0], Error) and events[0].code == "context_length_exceeded"
    assert events[0].param == "max_tokens"
