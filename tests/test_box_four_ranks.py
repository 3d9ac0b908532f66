"""The box as its users drive it: `appliance serve --devices cpu:4` (four gloo ranks, the embedded tiny V4.1
with its DSpark drafter, --check-ranks: every collective's call and every request's end state compared across
ranks) behind the official `openai` and `anthropic` SDKs and decode.v1. A BOS-led chat request right after
the warm-up (every chat request is BOS-led: once the first one killed the service), an agent's conversation
with tools whose later turns reuse the prefix, a side request between turns, cancels during a prefill and
during decode, a restart that resumes the conversation from --prefix-cache-dir; afterwards the service is
alive and no rank diverged. Inputs are fresh random words each run."""

import json
import random

import anthropic
import openai
import pytest

from .server_harness import ServerProcess, child_env, generate, open_ws, recv, send, until_end

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
rng = random.Random()
NO_EOS = {"ignore_eos": True}  # the tiny random model may end a reply on its first token; the tests count tokens


def words(n: int = 5) -> str:
    return " ".join(rng.choice(["tide", "lamp", "river", "cobalt", "north", "ember", "quill", "moss", "orbit", "fern",
                                "salt", "vault", "drift"]) for _ in range(n))


def serve(*args: str) -> ServerProcess:
    server = ServerProcess("--devices", "cpu:4", "--check-ranks", *args, env=child_env(APPLIANCE_THREADS="1"),
                           wait_ready=False)
    server.wait_ready(600)  # four ranks warming up on two busy cores
    log = "".join(server.lines)
    for rank in range(1, 4):  # each rank names the shard it loads
        assert f"rank {rank}: loading weights (rank {rank} of 4)" in log, log
    return server


def clients(server: ServerProcess, timeout: float = 120):
    base = f"http://127.0.0.1:{server.port}"
    return (openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=timeout),
            anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=timeout))


def healthy(server: ServerProcess) -> None:
    """Alive, ready, and no rank diverged or died (the log would name it)."""
    assert server.proc.poll() is None, "".join(server.lines)
    assert server.http("/healthz")[0] == 200 and server.http("/readyz")[0] == 200
    log = "".join(server.lines)
    assert "diverged" not in log and "exited with code" not in log and "Traceback" not in log, log


def turn(oa, history: list[dict]) -> tuple[dict, int]:
    """One streamed chat turn with tools: the assistant message to append, and the prompt's cached tokens."""
    stream = oa.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=6, stream=True,
                                        stream_options={"include_usage": True}, extra_body=NO_EOS)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 6
    return {"role": "assistant", "content": content}, usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_four_ranks_serve_a_bos_led_chat_an_agent_conversation_side_requests_cancels_and_a_restart(tmp_path):
    cache = tmp_path / "prefix-cache"
    server = serve("--draft", "auto", "--prefix-cache-dir", str(cache), "--chunk", "8")
    try:
        oa, an = clients(server)
        with open_ws(server, token=None) as ws:
            recv(ws)  # hello
            bos = generate(ws, "bos", [0, 5, 9, 13], 3)  # the first request after the warm-up, BOS-led
            assert bos[-1]["type"] == "done", bos[-1]
        first = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": words()}], max_tokens=4,
                                           extra_body=NO_EOS)
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 4

        history = [{"role": "system", "content": "You answer about the weather. " + words(8)},
                   {"role": "user", "content": words()}]
        answer, cached = turn(oa, history)
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": json.dumps({"city": words(1)})}}
        history += [answer | {"tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sky": words(2)})}]
        answer, cached = turn(oa, history)
        assert cached > 0, "the second turn restores the first's prefix"
        side = an.messages.create(model="m", max_tokens=4, system="Give a title. " + words(),
                                  messages=[{"role": "user", "content": words()}])
        # the Messages API has no ignore_eos: the random model may end the reply on its first token
        assert side.stop_reason == "end_turn" or (side.stop_reason == "max_tokens" and side.usage.output_tokens == 4)
        history += [answer, {"role": "user", "content": words()}]
        answer, cached = turn(oa, history)
        assert cached > 0, "after a side request the conversation's prefix is restored from the prefix cache"

        with open_ws(server, token=None) as ws:
            recv(ws)
            send(ws, {"type": "generate", "id": "long", "input_ids": [rng.randrange(8, 500) for _ in range(300)],
                      "max_tokens": 4})
            while (f := recv(ws))["type"] != "progress":
                assert f["type"] == "started", f
            send(ws, {"type": "cancel", "id": "long"})
            frames = until_end(ws, "long")
            assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled", frames[-1]
            send(ws, {"type": "generate", "id": "decode", "input_ids": [7, 9, 11], "max_tokens": 400,
                      "ignore_eos": True})
            while (f := recv(ws))["type"] != "delta":
                pass
            send(ws, {"type": "cancel", "id": "decode"})
            frames = until_end(ws, "decode")
            assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled", frames[-1]
            assert frames[-1]["usage"]["completion_tokens"] < 400
        healthy(server)
    finally:
        assert server.stop() == 0, "".join(server.lines)

    server = serve("--draft", "auto", "--prefix-cache-dir", str(cache), "--chunk", "8")  # a restart: from disk
    try:
        oa, _ = clients(server)
        history += [answer, {"role": "user", "content": words()}]
        _, cached = turn(oa, history)
        assert cached > 0, "after a restart the conversation's prefix is restored from disk"
        healthy(server)
    finally:
        assert server.stop() == 0, "".join(server.lines)


@pytest.mark.slow
def test_four_ranks_on_the_fast_path_serve_a_bos_led_chat_and_reuse_its_prefix(tmp_path):
    """The Triton kernels under the interpreter on four ranks, their sums over ranks as the box takes them
    (`--allreduce symm`, its default where GPUs reach each other: here buffers and flags in shared memory, the
    consumers' waits inside the interpreted kernels): few tokens (each takes seconds here, a minute and more
    on two busy cores)."""
    server = serve("--path", "fast", "--allreduce", "symm")
    try:
        oa, _ = clients(server, timeout=900)
        history = [{"role": "user", "content": words()}]
        answer = oa.chat.completions.create(model="m", messages=history, max_tokens=2).choices[0].message
        history += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": words(2)}]
        again = oa.chat.completions.create(model="m", messages=history, max_tokens=2, extra_body=NO_EOS)
        assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.usage.completion_tokens == 2
        healthy(server)
    finally:
        assert server.stop() == 0, "".join(server.lines)
