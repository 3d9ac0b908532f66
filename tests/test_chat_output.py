"""The output parser: the spec's worked examples parse exactly; streamed one character at a time or in
random splits (a fresh seed each run, printed on failure) it gives the same message and never shows a
marker or special token; malformed tool calls become content plus the flag, never an exception."""

import json
import random
import re
from pathlib import Path

import pytest

from appliance.chat import DIALECTS, OutputParser, TextDelta, ToolCallDelta, parse
from appliance.chat.dialects import EOS, HIDDEN_TOKENS
from appliance.chat.dsml import Tags

DATA = Path(__file__).parent / "data" / "chat"
PARSE = json.loads((DATA / "parse_examples.json").read_text())
STREAM = json.loads((DATA / "stream_example.json").read_text())
NEVER_SHOWN = ("</think>", "<think>", "｜DSML｜", EOS, *HIDDEN_TOKENS)
CASES = [pytest.param(c, d, id=f"{c['example']}-{d}") for c in PARSE for d in c["dialects"]]


def numbered(index: int) -> str:
    return f"call_{index}"


def stream(text: str, dialect: str, thinking: bool, cuts: list[int]):
    """(message, deltas) from feeding `text` cut at `cuts`."""
    parser = OutputParser(DIALECTS[dialect], thinking=thinking, call_id=numbered)
    deltas, start = [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[start:cut])
        start = cut
    deltas += parser.finish()
    return parser.result(), deltas


def as_expected(message) -> dict:
    return {"content": message.content, "reasoning_content": message.reasoning_content,
            "tool_calls": [{"type": c["type"], "function": c["function"]} for c in message.tool_calls],
            "finish_reason": message.finish_reason, "malformed": message.malformed_tool_call is not None}


def shown(deltas) -> list[str]:
    return [d.text for d in deltas if isinstance(d, TextDelta)]


@pytest.mark.parametrize("case,dialect", CASES)
def test_every_worked_example_parses_to_the_exact_message(case, dialect):
    assert as_expected(parse(case["text"], DIALECTS[dialect], thinking=case["thinking"])) == case["expected"]


@pytest.mark.parametrize("case,dialect", CASES)
def test_streaming_one_character_at_a_time_gives_the_same_message_and_shows_no_marker(case, dialect):
    text = case["text"]
    message, deltas = stream(text, dialect, case["thinking"], list(range(1, len(text))))
    assert message == parse(text, DIALECTS[dialect], thinking=case["thinking"], call_id=numbered)
    if not case["expected"]["malformed"]:
        for piece in shown(deltas):
            assert not any(m in piece for m in NEVER_SHOWN), piece


@pytest.mark.parametrize("case,dialect", CASES)
def test_streaming_in_random_splits_gives_the_same_message(case, dialect):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    text = case["text"]
    want = parse(text, DIALECTS[dialect], thinking=case["thinking"], call_id=numbered)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(40, len(text) - 1))))
        assert stream(text, dialect, case["thinking"], cuts)[0] == want, f"seed {seed}, cuts {cuts}"


@pytest.mark.parametrize("dialect", ["deepseek_v4", "deepseek_v41"])
def test_the_streaming_vector_of_example_10(dialect):
    chunks = STREAM["chunks"]
    if dialect == "deepseek_v41":  # the same split of the spaced text
        spaced = (("tool_calls", " calls"), ("tool_", " "), ("invoke", " invoke"), ("param", " param"))
        for old, new in spaced:
            chunks = [c.replace("｜DSML｜" + old, "｜DSML｜" + new) for c in chunks]
        assert "".join(chunks) == next(c["text"] for c in PARSE if c["example"] == "10a")
    parser = OutputParser(DIALECTS[dialect], thinking=True, call_id=numbered)
    per_chunk = [parser.feed(c) for c in chunks] + [parser.finish()]
    deltas = [d for out in per_chunk for d in out]
    assert shown(per_chunk[1]) == ["ties."]  # "</thi" is held back
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta) and d.channel == "reasoning") == \
        STREAM["expected"]["reasoning_content"]
    assert not [d for d in deltas if isinstance(d, TextDelta) and d.channel == "content"]
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls] == \
        STREAM["expected"]["tool_calls"]
    assert [c.openai()["index"] for c in calls] == [0, 1] and calls[0].openai()["id"] == "call_0"
    assert parser.finish_reason == STREAM["expected"]["finish_reason"]
    for piece in shown(deltas):
        assert not any(m in piece for m in STREAM["never_emitted"]), piece


def test_call_ids_default_to_openai_style_unique_ids():
    case = next(c for c in PARSE if c["example"] == "6")
    ids = [c["id"] for c in parse(case["text"], DIALECTS["deepseek_v4"], thinking=True).tool_calls]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


V4 = "deepseek_v4"
OPEN = "\n\n<｜DSML｜tool_calls>\n"
CLOSE = "</｜DSML｜tool_calls>"


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "".join(p + "\n" for p in params) + "</｜DSML｜invoke>\n"


def param(key: str, value: str, string: str = "true") -> str:
    return f'<｜DSML｜parameter name="{key}" string="{string}">{value}</｜DSML｜parameter>'


GOOD = invoke("f", param("a", "1", "false"))


@pytest.mark.parametrize("text,content,n_calls,reason", [
    ("Hi." + OPEN + invoke("f", param("a", "1"), param("a", "2")) + CLOSE + EOS, None, 0, "given twice"),
    ("Hi." + OPEN + invoke("f", param("a", "{oops", "false")) + CLOSE + EOS, None, 0, "not JSON"),
    ("Hi." + OPEN + invoke("f", param("a", "NaN", "false")) + CLOSE + EOS, None, 0, "not JSON"),
    ("Hi." + OPEN + invoke("f", '<｜DSML｜parameter name="a">x</｜DSML｜parameter>') + CLOSE + EOS, None, 0,
     "string="),
    ("Hi." + OPEN + invoke("") + CLOSE + EOS, None, 0, "without a name"),
    ("Hi." + OPEN + "garbage" + CLOSE + EOS, None, 0, "expected"),
    ("Hi." + OPEN + '<｜DSML｜invoke name="f">\n' + '<｜DSML｜parameter name="a" string="true">x' + EOS, None, 0,
     "unfinished"),
    ("Hi." + OPEN + GOOD + invoke("g", param("b", "x"), param("b", "y")) + CLOSE + EOS, None, 1, "given twice"),
    ("Hi." + OPEN + GOOD + '<｜DSML｜invoke name="g">\n' + param("b", "cut by the length li"), None, 1, "unfinished"),
    ("Hi.</｜DSML｜invoke> done" + EOS, "Hi.</｜DSML｜invoke> done", 0, "closing tag"),
    ("Hi." + "\n\n<｜DSML｜ calls>\n" + EOS, "Hi.\n\n<｜DSML｜ calls>\n", 0, "expected"),
])
def test_a_malformed_tool_call_becomes_content_and_sets_the_flag(text, content, n_calls, reason):
    message = parse(text, DIALECTS[V4], thinking=False)
    assert reason in message.malformed_tool_call
    assert len(message.tool_calls) == n_calls
    if content is None:  # the text after the last good call is shown as it was written
        good_end = text.index(GOOD) + len(GOOD.rstrip("\n")) if n_calls else len("Hi.")
        content = "Hi." + text[good_end:].replace(EOS, "")
    assert message.content == content
    assert message.finish_reason == ("tool_calls" if n_calls else "stop" if EOS in text else None)
    for cut in range(len(text) + 1):
        assert stream(text, V4, False, [cut])[0].as_dict() == parse(text, DIALECTS[V4], thinking=False,
                                                                     call_id=numbered).as_dict()


def test_a_tool_block_inside_reasoning_ends_the_reasoning():
    text = "Let me look." + OPEN + GOOD + CLOSE + EOS
    message = parse(text, DIALECTS[V4], thinking=True)
    assert (message.reasoning_content, message.content, message.malformed_tool_call) == ("Let me look.", "", None)
    assert message.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_an_eos_in_place_of_the_block_end_closes_the_block():
    for text in ("x" + OPEN + GOOD + EOS, "x" + OPEN + GOOD):
        message = parse(text, DIALECTS[V4], thinking=False)
        assert (message.content, len(message.tool_calls), message.malformed_tool_call) == ("x", 1, None)
        assert message.finish_reason == "tool_calls"


def test_a_call_without_parameters_has_empty_arguments_and_spacing_is_tolerated():
    text = OPEN + '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n  ' + invoke("f", param("k", ' "q"\n', "true")) \
        + CLOSE + EOS
    calls = parse(text, DIALECTS[V4], thinking=False).tool_calls
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"k": " \\"q\\"\\n"}']


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_string_value_runs_to_its_closing_tag_whatever_markup_or_end_of_sentence_text_it_holds(dialect):
    """The reference reads a parameter's value up to its closing tag (spec §4.2 step 3)."""
    d = DIALECTS[dialect]
    tags = Tags.of(d)
    value = f'see {tags.invoke_open}g">\n{tags.block_close} and {EOS} and {tags.param_open}x" string="true">'
    text = ("x\n\n" + tags.block_open + "\n" + tags.invoke_open + 'f">\n' + tags.param_open + 'code" string="true">'
            + value + tags.param_close + "\n" + tags.invoke_close + "\n" + tags.block_close + EOS)
    message = parse(text, d, thinking=False, call_id=numbered)
    assert message.malformed_tool_call is None and message.content == "x"
    assert [c["function"] for c in message.tool_calls] == [{"name": "f", "arguments": json.dumps(
        {"code": value}, ensure_ascii=False)}]
    for cuts in ([k] for k in range(0, len(text), 7)):
        assert stream(text, dialect, False, cuts)[0] == message


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_content_ending_in_newlines_before_a_tool_block_keeps_them(dialect):
    """Only the block marker's own two newlines are not content (spec §4.2 step 2)."""
    d = DIALECTS[dialect]
    tags = Tags.of(d)
    block = tags.block_open + "\n" + tags.invoke_open + 'f">\n\n' + tags.invoke_close + "\n" + tags.block_close + EOS
    for content in ("a\n", "a\n\n", "a\n\n\n", "\n\n"):
        text = content + "\n\n" + block
        message = parse(text, d, thinking=False, call_id=numbered)
        assert (message.content, len(message.tool_calls)) == (content, 1), repr(text)
        assert stream(text, dialect, False, list(range(1, len(text))))[0] == message


def test_markers_and_special_tokens_never_show_and_text_that_is_no_marker_is_released():
    text = "<think>a < b </thing> c<｜User｜>\n\n<｜Assi" + "stant｜>d\n\n" + EOS + "after the end"
    message, deltas = stream(text, V4, True, list(range(1, len(text))))
    assert message.reasoning_content == "a < b </thing> c\n\nd\n\n" and message.content == ""
    assert message.finish_reason == "stop"
    parser = OutputParser(DIALECTS[V4], thinking=False)
    assert shown(parser.feed("x <")) == ["x "] and shown(parser.feed("b")) == ["<b"]
    assert shown(parser.feed("\n\n")) == [] and shown(parser.finish()) == ["\n\n"]


PIECES = ["</think>", "<think>", EOS, "\n", "\n\n", "<｜DSML｜", "tool_calls>", " calls>", 'invoke name="f">',
          ' invoke name="g">', 'parameter name="a" string="true">', ' parameter name="b" string="false">',
          "</｜DSML｜parameter>", "</｜DSML｜ parameter>", "</｜DSML｜invoke>", "</｜DSML｜ invoke>", CLOSE,
          "</｜DSML｜ calls>", "x", "1", "{}", '"', "<", ">", "<｜User｜>", "<｜", "｜DSML｜", "é", " ", OPEN, GOOD]


def test_random_markup_never_raises_and_streams_exactly_as_it_parses():
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 25)))
        for dialect in DIALECTS:
            thinking = rng.random() < 0.5
            want = parse(text, DIALECTS[dialect], thinking=thinking, call_id=numbered)
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
            assert stream(text, dialect, thinking, cuts)[0] == want, f"seed {seed}: {text!r} cut at {cuts}"
