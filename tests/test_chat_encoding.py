"""The chat encoder gives the reference prompt, byte for byte: the spec's worked examples for every dialect
(tests/data/chat, each case naming its source), the OpenAI request mapping, and validation errors that
name the field."""

import json
from pathlib import Path

import pytest

from appliance.api import ChatRequest
from appliance.chat import DIALECTS, dialect_for_model, encode_messages, encode_request, get_dialect, parse
from appliance.chat.dialects import BOS, EOS, SYSTEM
from appliance.errors import RequestError

DATA = Path(__file__).parent / "data" / "chat"
ENCODE = json.loads((DATA / "encode_examples.json").read_text())
REQUESTS = json.loads((DATA / "request_examples.json").read_text())
PARSE = json.loads((DATA / "parse_examples.json").read_text())
WEATHER = ENCODE[8]["messages"][0]["tools"][0]


def encode(body, dialect):
    """A request body through the one way in: ChatRequest.from_body, then the encoder."""
    return encode_request(ChatRequest.from_body(body), dialect)


def _cases(cases):
    return [pytest.param(c, d, id=f"{c['example']}-{d}") for c in cases for d in c["dialects"]]


@pytest.mark.parametrize("case,dialect", _cases(ENCODE))
def test_every_worked_example_encodes_to_the_exact_prompt(case, dialect):
    got = encode_messages(case["messages"], DIALECTS[dialect], thinking=case["thinking"],
                          reasoning_effort=case["reasoning_effort"], drop_thinking=case["drop_thinking"])
    assert got == case["prompt"]


@pytest.mark.parametrize("case", REQUESTS, ids=[f"{c['example']}-{c['dialect']}" for c in REQUESTS])
def test_every_worked_request_body_encodes_to_the_exact_prompt(case):
    prompt = encode(case["request"], DIALECTS[case["dialect"]])
    assert prompt.text == case["prompt"]
    assert prompt.thinking == prompt.text.endswith("<think>")


def test_every_dialect_has_its_examples():
    for name in DIALECTS:
        assert {c["example"][0] for c in ENCODE if name in c["dialects"]} >= set("1234"), name


def test_encoding_leaves_the_callers_messages_unchanged():
    messages = json.loads(json.dumps(ENCODE[8]["messages"]))
    encode_messages(messages, DIALECTS["deepseek_v4"], thinking=True)
    assert messages == ENCODE[8]["messages"]


@pytest.mark.parametrize("dialect,example", [("deepseek_v4", "6"), ("deepseek_v41", "10a")])
def test_a_parsed_tool_call_turn_re_encodes_to_exactly_the_model_output(dialect, example):
    """Example 6 / 10's round trip: prompt (Example 3's first two messages) + output = the encoding of the
    history with the parsed message appended."""
    d = DIALECTS[dialect]
    output = next(c["text"] for c in PARSE if c["example"] == example and dialect in c["dialects"])
    history = ENCODE[8]["messages"][:2]
    prompt = encode_messages(history, d, thinking=True)
    parsed = parse(output, d, thinking=True)
    turn = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning_content,
            "tool_calls": parsed.tool_calls}
    assert encode_messages([*history, turn], d, thinking=True) == prompt + output


def test_request_tools_create_a_leading_system_message_when_there_is_none():
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "thinking": False}
    v4 = encode(body, DIALECTS["deepseek_v4"]).text
    v41 = encode(body, DIALECTS["deepseek_v41"]).text
    assert v4.startswith(BOS + "\n\n## Tools\n\n") and '"<｜DSML｜tool_calls>" block' in v4
    assert v41.startswith(BOS + SYSTEM + "\n\n## Tools\n\n") and '"<｜DSML｜ calls>" block' in v41
    assert v4.endswith("tool calls.\n<｜User｜>Weather?<｜Assistant｜></think>")


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt():
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "tool_choice": "none"}
    assert encode(body, DIALECTS["deepseek_v41"]).text == \
        encode({"messages": body["messages"]}, DIALECTS["deepseek_v41"]).text


def test_response_format_follows_the_tools_in_the_system_message():
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
            "tools": [WEATHER], "response_format": rf, "thinking": False}
    text = encode(body, DIALECTS["deepseek_v4"]).text
    tail = ("invoke tool calls.\n\n\n## Response Format:\n\n"
            "You MUST strictly adhere to the following schema to reply:\n"
            '{"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}<｜User｜>Hi')
    assert text.startswith(BOS + "S\n\n## Tools") and tail in text
    plain = encode({**body, "response_format": {"type": "text"}, "tools": None}, DIALECTS["deepseek_v4"])
    assert plain.text == BOS + "S<｜User｜>Hi<｜Assistant｜></think>"


def test_content_parts_consecutive_user_turns_and_tool_results_join_with_a_blank_line():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"thinking": False, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "user", "content": "next"}]}
    assert encode(body, DIALECTS["deepseek_v4"]).text == (
        BOS + "<｜User｜>a\n\nb\n\nc<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS + "<｜User｜><tool_result>r1\n\nr2</tool_result>\n\nnext"
        "<｜Assistant｜></think>")


def test_tool_results_follow_the_call_order_and_text_blocks_keep_their_place():
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": {"n": k}}} for k, i in
             enumerate(["x", "y", "z"])]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "z", "content": "Z"}, {"role": "user", "content": "note"},
            {"role": "tool", "tool_call_id": "x", "content": "X"},
            {"role": "tool", "tool_call_id": "y", "content": "Y"}]
    text = encode_messages(msgs, DIALECTS["deepseek_v41"], thinking=False)
    assert text.endswith("<｜User｜><tool_result>X</tool_result>\n\nnote\n\n<tool_result>Y</tool_result>\n\n"
                         "<tool_result>Z</tool_result><｜Assistant｜></think>")
    assert '<｜DSML｜ parameter name="n" string="false">0</｜DSML｜ parameter>' in text


def test_arguments_are_written_raw_for_strings_and_as_json_otherwise():
    args = {"s": 'He said "hi"\n', "i": 2, "f": 1.5, "b": True, "n": None, "l": [1, "é"], "o": {"k": "v"}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps(args)}}
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = encode_messages(msgs, DIALECTS["deepseek_v4"], thinking=False)
    for line in ['name="s" string="true">He said "hi"\n</', 'name="i" string="false">2<',
                 'name="f" string="false">1.5<', 'name="b" string="false">true<', 'name="n" string="false">null<',
                 'name="l" string="false">[1, "é"]<', 'name="o" string="false">{"k": "v"}<']:
        assert line in text, line


def test_a_developer_message_is_a_user_turn_on_v4_and_the_system_prompt_on_v41():
    body = {"messages": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}],
            "thinking": False}
    assert encode(body, DIALECTS["deepseek_v4"]).text == \
        BOS + "<｜User｜>Rules.<｜User｜>Hi<｜Assistant｜></think>"
    assert encode(body, DIALECTS["deepseek_v41"]).text == \
        BOS + SYSTEM + "Rules.<｜User｜>Hi<｜Assistant｜></think>"
    with pytest.raises(RequestError, match="no developer role"):
        encode_messages(body["messages"], DIALECTS["deepseek_v41"], thinking=False)


def test_reasoning_effort_none_turns_thinking_off_and_efforts_map_to_each_table():
    user = [{"role": "user", "content": "q"}]
    off = encode({"messages": user, "reasoning_effort": "none"}, DIALECTS["deepseek_v41"])
    assert not off.thinking and off.text.endswith("</think>") and SYSTEM not in off.text
    for value, level in (("minimal", 50), ("medium", 50), ("xhigh", 75), (None, 75), (7, 7)):
        text = encode({"messages": user, "reasoning_effort": value}, DIALECTS["deepseek_v41"]).text
        assert f"Reasoning Effort: {level} (" in text, value
    assert "Beyond maximum" in encode({"messages": user, "reasoning_effort": "max"},
                                              DIALECTS["deepseek_v4_0731"]).text
    assert "Reasoning" not in encode({"messages": user, "reasoning_effort": "medium"},
                                             DIALECTS["deepseek_v4"]).text


@pytest.mark.parametrize("dialect,effort", [("deepseek_v4", "low"), ("deepseek_v4", 50), ("deepseek_v4_0731", "xhigh"),
                                            ("deepseek_v41", 0), ("deepseek_v41", 101), ("deepseek_v41", True),
                                            ("deepseek_v41", 1.5), ("deepseek_v41", "50")])
def test_the_encoder_refuses_an_effort_outside_its_dialects_table(dialect, effort):
    with pytest.raises(RequestError) as e:
        encode_messages([{"role": "user", "content": "q"}], DIALECTS[dialect], thinking=True, reasoning_effort=effort)
    assert e.value.field == "reasoning_effort"


def _call(arguments):
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}


USER = {"role": "user", "content": "q"}


@pytest.mark.parametrize("body,field", [
    ([], "body"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [_call("{nope")]}, USER]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [_call("[1, 2]")]}, USER]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
                   USER]}, "messages[1].tool_calls[0].function.name"),
    ({"messages": [USER, {"role": "assistant", "content": "", "reasoning_content": 5}, USER]},
     "messages[1].reasoning_content"),
    ({"messages": [USER, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "assistant", "content": "a"}, {"role": "latest_reminder", "content": "r"}]},
     "messages[1].role"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "messages[0].role"),
    ({"messages": [USER, {"role": "assistant", "content": "a", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls"),
    ({"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "function", "function": [1]}}, "tool_choice"),
    ({"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "description": 7}}]},
     "tools[0].function.description"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name"),
    ({"messages": [USER], "tools": {"f": 1}}, "tools"),
    ({"messages": [USER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"messages": [USER], "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [USER], "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": [USER], "reasoning_effort": "none", "thinking": True}, "reasoning_effort"),
    ({"messages": [USER], "thinking": "yes"}, "thinking"),
    ({"messages": [USER], "chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
])
def test_a_bad_request_raises_a_request_error_naming_the_field(body, field):
    with pytest.raises(RequestError) as e:
        encode(body, DIALECTS["deepseek_v41"])
    assert e.value.field == field and e.value.code == "invalid_request"
    assert e.value.message.startswith(field.split("[")[0]) or field == "body", e.value.message


def test_integer_efforts_and_empty_developer_messages_are_refused_on_v4_the_image_placeholder_on_v41():
    with pytest.raises(RequestError, match="developer message needs text"):
        encode({"messages": [{"role": "developer", "content": ""}, USER]}, DIALECTS["deepseek_v4"])
    with pytest.raises(RequestError, match="reasoning_effort=42"):
        encode({"messages": [USER], "reasoning_effort": 42}, DIALECTS["deepseek_v4_0731"])
    with pytest.raises(RequestError, match="image placeholder"):
        encode({"messages": [{"role": "user", "content": "<｜deepseek_image｜>"}]}, DIALECTS["deepseek_v41"])


def test_arguments_may_be_an_object_or_json_of_json_and_empty_text_is_the_one_string_parameter_arguments():
    """The reference renders text it cannot parse as JSON (empty and blank text among it) as one string
    parameter named `arguments` (spec §2.7); no arguments at all is a call without parameters."""
    for arguments in ({"city": "Paris"}, json.dumps(json.dumps({"city": "Paris"})), '{"city": "Paris"}'):
        body = {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [_call(arguments)]}, USER]}
        assert 'name="city" string="true">Paris<' in encode(body, DIALECTS["deepseek_v4"]).text
    for blank in ("", "  \n"):
        body = {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [_call(blank)]}, USER]}
        want = f'<｜DSML｜parameter name="arguments" string="true">{blank}</｜DSML｜parameter>'
        prompt = encode(body, DIALECTS["deepseek_v4"]).text
        assert f'<｜DSML｜invoke name="f">\n{want}\n</｜DSML｜invoke>' in prompt
    body = {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [_call(None)]}, USER]}
    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in encode(body, DIALECTS["deepseek_v4"]).text


def _nested(depth: int):
    """Objects and arrays nested `depth` levels, an object outermost."""
    value: object = 1
    for k in range(depth):
        value = [value] if (depth - 1 - k) % 2 else {"a": value}
    return value


@pytest.mark.parametrize("where", ["parameters", "response_format", "arguments", "arguments text"])
def test_json_nested_past_the_limit_anywhere_is_refused_naming_the_field_and_64_levels_are_rendered(where):
    def body(value) -> dict:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        if where == "parameters":
            tool["function"]["parameters"] = value
        call = _call(json.dumps({"x": value}) if where == "arguments text" else {"x": value}
                     if where == "arguments" else "{}")
        return {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [call]}, USER], "tools": [tool],
                **({"response_format": {"type": "json_schema", "json_schema": value}}
                   if where == "response_format" else {})}

    shallow = 63  # one level more holds it: the function object, the response format, the arguments' {"x": ...}
    encode(body(_nested(shallow)), DIALECTS["deepseek_v41"])
    for depth in (shallow + 1, 5000):  # far deeper than the JSON writers could recurse
        text = "[" * 100_000 if depth == 5000 and where == "arguments text" else None
        bad = body(_nested(depth)) if text is None else {"messages": [USER, {
            "role": "assistant", "content": "", "tool_calls": [_call(text)]}, USER]}
        with pytest.raises(RequestError) as e:
            encode(bad, DIALECTS["deepseek_v41"])
        assert "nested deeper than 64" in e.value.message and e.value.field.endswith(
            {"parameters": "function", "response_format": "response_format"}.get(where, "arguments")), e.value.field


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_an_empty_content_list_next_to_another_user_or_tool_block_adds_no_block(dialect):
    """The reference renders no block for a user message whose content list is empty (spec §2.2)."""
    d = DIALECTS[dialect]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_empty = [USER, {"role": "user", "content": []}, {"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "user", "content": []}]
    without = [USER, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    for thinking in (True, False):
        got = encode({"messages": with_empty, "thinking": thinking}, d).text
        assert got == encode({"messages": without, "thinking": thinking}, d).text
        assert "<tool_result>r</tool_result><｜Assistant｜>" in got


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_an_assistant_prefill_ends_the_prompt_inside_the_assistant_turn(dialect):
    """The last message an assistant's: the prompt ends where its text ends (no end-of-sentence), so the model
    continues it; in thinking mode a prefill of reasoning alone leaves the reasoning open."""
    d = DIALECTS[dialect]
    base = encode({"messages": [USER]}, d).text
    assert base.endswith("<｜Assistant｜><think>")
    content = encode({"messages": [USER, {"role": "assistant", "content": "Sure, "}]}, d)
    assert content.text == base + "</think>Sure, " and not content.thinking
    reasoning = encode({"messages": [USER, {"role": "assistant", "content": None,
                                                    "reasoning_content": "First, "}]}, d)
    assert reasoning.text == base + "First, " and reasoning.thinking
    chat = encode({"messages": [USER, {"role": "assistant", "content": "Sure"}], "thinking": False}, d)
    assert chat.text == encode({"messages": [USER], "thinking": False}, d).text + "Sure"
    assert not chat.thinking and EOS not in chat.text[len(base) - 20:]
    with pytest.raises(RequestError) as e:
        encode({"messages": [USER, {"role": "assistant", "content": "x"}], "tools": [WEATHER],
                        "tool_choice": "required"}, d)
    assert e.value.field == "tool_choice"


def test_each_dialect_names_the_spec_token_ids_and_sampling_defaults():
    v4, v41 = DIALECTS["deepseek_v4"], DIALECTS["deepseek_v41"]
    assert (v4.bos_id, v4.eos_id, v41.bos_id, v41.eos_id) == (0, 1, 0, 1)
    assert v41.special_tokens[SYSTEM] == 128799 and SYSTEM not in v4.special_tokens
    assert {v4.special_tokens[t] for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")} == \
        {128803, 128804, 128821, 128822, 128825}
    assert all((d.temperature, d.top_p) == (1.0, 1.0) for d in DIALECTS.values())


def test_the_dialect_follows_the_model_family_and_its_drafter():
    assert dialect_for_model("deepseek_v41", has_dspark=True).name == "deepseek_v41"
    assert dialect_for_model("deepseek_v4", has_dspark=True).name == "deepseek_v4_0731"
    assert dialect_for_model("deepseek_v4", has_dspark=False).name == "deepseek_v4"
    with pytest.raises(RequestError):
        get_dialect("llama")
