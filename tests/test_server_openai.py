"""The official `openai` SDK against the OpenAI-compatible routes of one in-process server whose engine is
scripted (tests/scripted_engine.py: the request loop, chat encoding, tokenizer and output parser are real,
the model's output is the test's): chat streamed and not, reasoning, thinking on and off, a parallel
tool-call round trip, usage and cached tokens, completions, models, bad values, auth, busy as 429, and a
client that disconnects cancelling its request. Inputs are fresh random words each run."""

import json
import random
import time
import urllib.request

import openai
import pytest

from appliance.api import ChatRequest
from appliance.chat import DIALECTS, encode_request
from tests.scripted_engine import scripted_box, scripted_engine, words
from tests.server_harness import TOKEN, InProcessServer

V41 = DIALECTS["deepseek_v41"]
rng = random.Random()
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": CITY_SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def box():
    yield from scripted_box()


@pytest.fixture
def client(box):
    return openai.OpenAI(base_url=box[0].base + "/v1", api_key=TOKEN, max_retries=0, timeout=30)


def expected_ids(session, body: dict) -> list[int]:
    return session.tokenizer.encode(encode_request(ChatRequest.from_body(body), V41).text)


def test_an_unstreamed_chat_answers_with_the_scripted_reasoning_and_content_and_the_exact_prompt(box, client):
    server, session = box
    question, thought, answer = words(), words(), words(6)
    session.script(f"{thought}</think>{answer}")
    messages = [{"role": "system", "content": words()}, {"role": "user", "content": question}]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=500, temperature=0.3, seed=5)
    choice = r.choices[0]
    assert choice.message.content == answer and choice.message.model_extra["reasoning_content"] == thought
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert session.prompts[-1] == expected_ids(session, {"messages": messages})  # thinking on, default effort
    assert r.usage.prompt_tokens == len(session.prompts[-1]) and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == "scripted" and r.object == "chat.completion"
    assert (session.samplings[-1].temperature, session.samplings[-1].seed) == (0.3, 5)


def test_a_streamed_chat_sends_reasoning_then_content_deltas_and_usage_with_cached_tokens(box, client):
    server, session = box
    first_q, thought, answer = words(), words(8), words(8)
    session.script(f"{words()}</think>{words()}")
    history = [{"role": "user", "content": first_q}]
    client.chat.completions.create(model="m", messages=history, max_tokens=500)
    session.script(f"{thought}</think>{answer}")
    messages = history + [{"role": "assistant", "content": words()}, {"role": "user", "content": words()}]
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=500, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == thought and content == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    kinds = [("r" if c.choices[0].delta.model_extra.get("reasoning_content") else "c")
             for c in chunks[1:] if c.choices and (c.choices[0].delta.content or
                                                   c.choices[0].delta.model_extra.get("reasoning_content"))]
    assert kinds == sorted(kinds, reverse=True), kinds  # every reasoning delta before the first content delta
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == len(session.prompts[-1])
    common = 0
    while session.prompts[-2][common] == session.prompts[-1][common]:
        common += 1
    assert usage.prompt_tokens_details.cached_tokens == common > 0


@pytest.mark.parametrize("switch", [{"thinking": False}, {"chat_template_kwargs": {"thinking": False}},
                                    {"reasoning_effort": "none"}])
def test_thinking_off_ends_the_prompt_with_the_closed_think_tag_and_the_answer_is_all_content(box, client, switch):
    server, session = box
    answer = words(5)
    session.script(answer)
    messages = [{"role": "user", "content": words()}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=500, extra_body=switch)
    assert r.choices[0].message.content == answer and not r.choices[0].message.model_extra.get("reasoning_content")
    assert session.prompts[-1] == expected_ids(session, {"messages": messages, "thinking": False})
    assert session.prompt_text().endswith("<｜Assistant｜></think>")


def test_reasoning_effort_and_response_format_reach_the_prompt(box, client):
    server, session = box
    session.script("x</think>{}")
    messages = [{"role": "user", "content": words()}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=8, reasoning_effort="max",
                                   response_format={"type": "json_object"})
    assert session.prompts[-1] == expected_ids(session, {"messages": messages, "reasoning_effort": "max",
                                                         "response_format": {"type": "json_object"}})
    assert "Reasoning Effort: 100" in session.prompt_text() and "## Response Format" in session.prompt_text()


def _calls_markup(city: str, days: int) -> str:
    return ("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
            f"<｜DSML｜ parameter name=\"city\" string=\"true\">{city}</｜DSML｜ parameter>\n"
            f"<｜DSML｜ parameter name=\"days\" string=\"false\">{days}</｜DSML｜ parameter>\n"
            "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"now\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>")


@pytest.mark.parametrize("stream", [False, True])
def test_a_parallel_tool_call_round_trip(box, client, stream):
    server, session = box
    city, days, thought = words(1).capitalize(), rng.randint(1, 9), words()
    session.script(f"{thought}</think>{_calls_markup(city, days)}")
    messages = [{"role": "user", "content": f"Weather in {city}, and the time?"}]
    kw = dict(model="m", messages=messages, tools=[WEATHER, CLOCK], max_tokens=800)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.index for d in deltas] == [0, 1]  # one whole call per delta, in order
        calls = [{"id": d.id, "type": "function", "function": {"name": d.function.name,
                                                                "arguments": d.function.arguments}} for d in deltas]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        calls = [c.model_dump() for c in r.choices[0].message.tool_calls]
        finish, content = r.choices[0].finish_reason, r.choices[0].message.content
    assert finish == "tool_calls" and not content
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": city, "days": days}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert "<｜DSML｜ calls>" in session.prompt_text() and '"name": "get_weather"' in session.prompt_text()

    answer = words(6)
    session.script(f"{words()}</think>{answer}")
    results = [{"role": "tool", "tool_call_id": calls[1]["id"], "content": "12:00"},  # out of order on purpose
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"sunny in {city}"}]
    follow = messages + [{"role": "assistant", "content": None, "reasoning_content": thought, "tool_calls": calls},
                         *results]
    r = client.chat.completions.create(model="m", messages=follow, tools=[WEATHER, CLOCK], max_tokens=500)
    assert r.choices[0].message.content == answer and r.choices[0].finish_reason == "stop"
    text = session.prompt_text()
    assert session.prompts[-1] == expected_ids(session, {"messages": follow, "tools": [WEATHER, CLOCK]})
    assert f"<tool_result>sunny in {city}</tool_result>\n\n<tool_result>12:00</tool_result>" in text
    assert thought in text  # tool loops keep the reasoning of the turn that called
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_a_named_tool_choice_opens_that_call_in_the_prompt(box, client):
    server, session = box
    city = words(1)
    session.script(f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>\n'
                   "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}], max_tokens=500,
                                       tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert session.prompt_text().endswith('<think></think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n')
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    assert r.choices[0].finish_reason == "tool_calls"


def test_completions_take_text_or_ids_and_stop_strings(box, client):
    server, session = box
    head, tail = words(3), words(3)
    session.script(f"{head} STOP {tail}")
    r = client.completions.create(model="m", prompt=words(), max_tokens=500, stop=["STOP"])
    assert r.choices[0].text == head + " " and r.choices[0].finish_reason == "stop"
    ids = [rng.randrange(5, 400) for _ in range(rng.randint(3, 9))]
    session.script(tail)
    chunks = list(client.completions.create(model="m", prompt=ids, max_tokens=500, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tail and session.prompts[-1] == ids


def test_models_lists_the_served_model(box, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["scripted"] and models[0].model_extra["max_model_len"] == 4096


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=5), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=True), "logprobs"), (dict(n=2), "n"), (dict(stop=[""]), "stop"),
    (dict(extra_body={"thinking": "maybe"}), "thinking"), (dict(reasoning_effort="extreme"), "reasoning_effort"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (dict(max_tokens=5000), "max_tokens"),  # over the context: the engine's check
])
def test_a_bad_value_is_a_400_in_openais_shape_naming_the_parameter(box, client, kw, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_unknown_fields_are_ignored(box, client):
    box[1].script("ok")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"not_a_field": [1, 2], "thinking": False}, user="someone")
    assert r.choices[0].message.content == "ok"


def test_a_missing_or_wrong_key_is_401_and_the_right_one_passes(box):
    server, session = box
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server.base + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={"Authorization": ""} if not key else None)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.response.headers["www-authenticate"].startswith("Bearer")
    req = urllib.request.Request(server.base + "/v1/models", headers={"x-api-key": TOKEN})  # Anthropic's header
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_with_on_busy_reject_while_a_stream_runs_a_second_call_is_429_with_retry_after_and_passes_once_it_ends(
        box, client):
    server, session = box
    session.script(words(15))
    session.token_delay_s = 0.01
    server.app.config.on_busy = "reject"  # read per call (the default is queue)
    try:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}],
                                                max_tokens=800, stream=True, extra_body={"thinking": False})
        next(iter(stream))
        busy_before = server.metric("decode_busy_rejections_total")
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
        assert server.metric("decode_busy_rejections_total") == busy_before + 1
        assert list(stream)[-1].choices[0].finish_reason == "stop"
    finally:
        session.token_delay_s = 0.0
        server.app.config.on_busy = "queue"
    session.script("done")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"thinking": False})
    assert r.choices[0].message.content == "done"


def _wait_idle(server, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (server.engine.busy or server.app.calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.engine.busy and not server.app.calls


def test_a_client_that_disconnects_mid_stream_cancels_its_request_within_a_cycle(box, client):
    server, session = box
    session.script(words(300))
    session.token_delay_s = 0.01
    cancelled = server.metric('decode_requests_total{finish_reason="cancelled"}')
    try:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}],
                                                max_tokens=2000, stream=True, extra_body={"thinking": False})
        chunks = iter(stream)
        for _ in range(6):
            next(chunks)
        stream.close()  # the SDK drops the connection
        at_close = session.cycles
        _wait_idle(server)
        after = session.cycles - at_close
    finally:
        session.token_delay_s = 0.0
        session.scripts.clear()
    assert server.metric('decode_requests_total{finish_reason="cancelled"}') == cancelled + 1
    assert after <= 5, after  # the scripted output had ~300 tokens left


def test_a_client_that_disconnects_during_a_long_prefill_stops_it_within_a_chunk(box, client):
    server, session = box
    session.chunk_delay_s = 0.02
    prompt = [rng.randrange(5, 400) for _ in range(16 * 100)]  # a hundred chunks of 16
    try:
        with pytest.raises(openai.APITimeoutError):  # the SDK gives up and closes the connection
            client.with_options(timeout=0.3).completions.create(model="m", prompt=prompt, max_tokens=4)
        at_close = session.chunks
        _wait_idle(server)
        after = session.chunks - at_close
    finally:
        session.chunk_delay_s = 0.0
    assert after <= 3, after
    assert len(session.state) < len(prompt)


def test_with_on_busy_queue_a_second_call_waits_for_the_first_and_is_then_served():
    import threading

    engine, session = scripted_engine()
    server = InProcessServer(engine, on_busy="queue")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=30)
        first, second = words(12), words(3)
        session.script(first)
        session.script(second)
        session.token_delay_s = 0.005
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                max_tokens=500, stream=True, extra_body={"thinking": False})
        chunks = iter(stream)
        next(chunks)
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "b"}], max_tokens=500, extra_body={"thinking": False})))
        waiter.start()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        waiter.join(30)
        assert text == first and answers[0].choices[0].message.content == second
    finally:
        assert server.stop() == 0
