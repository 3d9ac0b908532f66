"""The official `anthropic` SDK against `POST /v1/messages` of an in-process server with a scripted engine
(tests/scripted_engine.py): messages streamed and not, thinking blocks on and off, a tool_use / tool_result
round trip, stop sequences, usage with cached tokens, bad values, auth by x-api-key or Bearer, busy as 429.
Inputs are fresh random words each run."""


import anthropic
import pytest

from appliance.api import ChatRequest
from appliance.chat import DIALECTS, encode_request
from tests.scripted_engine import scripted_box, words
from tests.server_harness import TOKEN

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def box():
    yield from scripted_box()


@pytest.fixture
def client(box):
    return anthropic.Anthropic(base_url=box[0].base, api_key=TOKEN, max_retries=0, timeout=30)


def test_a_message_answers_with_a_thinking_block_then_a_text_block(box, client):
    server, session = box
    system, question, thought, answer = words(), words(), words(), words(6)
    session.script(f"{thought}</think>{answer}")
    m = client.messages.create(model="any", max_tokens=500, system=system,
                               messages=[{"role": "user", "content": question}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == thought and m.content[1].text == answer and m.stop_reason == "end_turn"
    chat = ChatRequest([{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert session.prompts[-1] == session.tokenizer.encode(encode_request(chat, DIALECTS["deepseek_v41"]).text)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(session.prompts[-1])
    assert m.usage.output_tokens > 0 and m.role == "assistant" and m.model == "scripted"


def test_a_streamed_message_with_thinking_disabled_is_text_only_and_reads_the_cached_prefix(box, client):
    server, session = box
    question, answer = words(), words(8)
    session.script(answer)
    first = [{"role": "user", "content": question}]
    client.messages.create(model="m", max_tokens=500, messages=first, thinking={"type": "disabled"})
    session.script(words(5))
    follow = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": words()}]
    with client.messages.stream(model="m", max_tokens=500, messages=follow, thinking={"type": "disabled"}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert session.prompt_text().endswith("<｜Assistant｜></think>")
    assert final.usage.cache_read_input_tokens > 0 and final.stop_reason == "end_turn"


def test_a_tool_use_round_trip_streamed(box, client):
    server, session = box
    city, thought = words(1).capitalize(), words()
    session.script(f'{thought}</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
                   f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>\n'
                   '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    messages = [{"role": "user", "content": f"Weather in {city}?"}]
    with client.messages.stream(model="m", max_tokens=800, messages=messages, tools=[WEATHER],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    use = final.content[1]
    assert use.name == "get_weather" and use.input == {"city": city} and use.id.startswith("toolu_")

    answer = words(5)
    session.script(f"{words()}</think>{answer}")
    follow = messages + [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": [{"type": "text", "text": f"rain in {city}"}]}]}]
    m = client.messages.create(model="m", max_tokens=500, messages=follow, tools=[WEATHER])
    assert m.content[-1].text == answer
    text = session.prompt_text()
    assert f"<tool_result>rain in {city}</tool_result>" in text and thought in text
    assert f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>' in text


def test_a_stop_sequence_ends_the_message_and_is_named(box, client):
    server, session = box
    head = words(3)
    session.script(f"{head}END{words()}")
    m = client.messages.create(model="m", max_tokens=500, messages=[{"role": "user", "content": words()}],
                               stop_sequences=["END"], thinking={"type": "disabled"})
    assert m.content[0].text == head and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")


@pytest.mark.parametrize("kw,where", [
    (dict(temperature=1.5), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "",
                                                                             "media_type": "image/png"}}]}]),
     "messages[0].content[0].type"),
    (dict(tool_choice={"type": "sometimes"}), "tool_choice"),
])
def test_a_bad_value_is_a_400_in_anthropics_shape_naming_the_parameter(box, client, kw, where):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(anthropic.BadRequestError) as e:  # extra_body: sent as it is (this SDK has no temperature)
        client.messages.create(model="m", max_tokens=10, messages=[], extra_body=body)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and where in e.value.body["error"]["message"]


def test_the_key_is_read_from_x_api_key_or_bearer_and_a_wrong_one_is_401(box):
    server, session = box
    for good in (anthropic.Anthropic(base_url=server.base, api_key=TOKEN, max_retries=0),
                 anthropic.Anthropic(base_url=server.base, auth_token=TOKEN, max_retries=0)):
        session.script("fine")
        m = good.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                 thinking={"type": "disabled"})
        assert m.content[0].text == "fine"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"


def test_with_on_busy_reject_while_another_call_streams_a_message_is_refused_with_429(box, client):
    server, session = box
    session.script(words(12))
    session.token_delay_s = 0.01
    server.app.config.on_busy = "reject"  # read per call (the default is queue)
    try:
        with client.messages.stream(model="m", max_tokens=500, messages=[{"role": "user", "content": "a"}],
                                    thinking={"type": "disabled"}) as s:
            next(iter(s.text_stream))
            with pytest.raises(anthropic.RateLimitError) as e:
                client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "b"}])
            assert e.value.status_code == 429 and e.value.response.headers["retry-after"]
            assert e.value.body["error"]["type"] == "rate_limit_error"
            s.get_final_message()
    finally:
        session.token_delay_s = 0.0
        server.app.config.on_busy = "queue"
