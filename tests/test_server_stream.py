"""A real server on a free loopback port with the tiny default model: streaming, HTTP routes, metrics, auth."""

import base64
import json
import subprocess
import sys

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.server_harness import (
    ROOT,
    TOKEN,
    ServerProcess,
    child_env,
    generate,
    open_ws,
    prompt,
    raw_http,
    recv,
    send,
    token_ids,
    until_end,
)

ORIGIN = "https://chat.example.com"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # /metrics asks for the token too (--metrics-auth, the default)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    s = ServerProcess("--chunk", "8", "--token-file", str(token_file), "--origin", ORIGIN)
    yield s
    assert s.stop() == 0


def test_streaming_sends_deltas_then_exactly_one_done_with_the_ids_of_appliance_generate(server, tmp_path):
    ids = prompt(11, 20)
    with open_ws(server) as ws:
        hello = recv(ws)
        frames = generate(ws, "s1", ids, 12)
    assert hello["type"] == "hello" and hello["state"] == "ready" and hello["protocol"] == "decode.v1"
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "started" and kinds[-1] == "done"
    assert kinds.count("done") == 1 and "error" not in kinds
    assert set(kinds[1:-1]) <= {"progress", "delta"} and "delta" in kinds
    first_delta = kinds.index("delta")
    assert all(k == "delta" for k in kinds[first_delta:-1]), "no progress after the first token"

    seqs = [hello["seq"]] + [f["seq"] for f in frames]
    assert all(b > a for a, b in zip(seqs, seqs[1:])), seqs
    deltas = [f for f in frames if f["type"] == "delta"]
    t_ms = [t for d in deltas for t in d["t_ms"]]
    assert len(t_ms) == 12 and all(b >= a for a, b in zip(t_ms, t_ms[1:])), t_ms
    index = 0
    for d in deltas:  # `index` is the position of the frame's first token
        assert d["index"] == index and d["id"] == "s1"
        index += len(d["token_ids"])
    done = frames[-1]
    assert done["finish_reason"] == "length"
    assert done["usage"] == {"prompt_tokens": 20, "completion_tokens": 12, "cached_tokens": 0}
    assert set(done["timings"]) >= {"queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "tpot_ms", "tokens_per_s",
                                    "e2e_ms"}

    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    r = subprocess.run([sys.executable, "-m", "appliance", "generate", "--ids", str(ids_file), "--max-tokens", "12",
                        "--ignore-eos", "--chunk", "8", "--json"], capture_output=True, text=True, cwd=ROOT,
                       env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert token_ids(frames) == json.loads(r.stdout)["ids"]


def test_hello_announces_the_limits_and_the_vocabulary_and_compression_stays_off(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with connect(server.url, subprotocols=["decode.v1"], additional_headers=auth, compression="deflate") as ws:
        hello = recv(ws)
        assert "Sec-WebSocket-Extensions" not in ws.response.headers  # permessage-deflate refused
    assert hello["seq"] == 1 and hello["model"] == "default_model" and hello["server_version"]
    limits = hello["limits"]
    assert limits["max_context"] == 4096 and limits["vocab_size"] == 512
    assert 1 <= limits["max_tokens"] <= 8192
    assert limits["max_message_bytes"] >= 4096 * 8  # a context full of input_ids fits


def test_a_text_prompt_streams_text_and_timings_none_leaves_out_t_ms_and_timings(server):
    with open_ws(server) as ws:
        recv(ws)
        send(ws, {"type": "generate", "id": "t", "prompt": "Hello, world!", "max_tokens": 5, "ignore_eos": True,
                  "timings": "none"})
        frames = until_end(ws, "t")
    deltas = [f for f in frames if f["type"] == "delta"]
    assert sum(len(d["token_ids"]) for d in deltas) == 5
    assert all("t_ms" not in d for d in deltas) and isinstance("".join(d["text"] for d in deltas), str)
    assert frames[-1]["type"] == "done" and "timings" not in frames[-1]


def test_ping_is_answered_with_pong_echoing_t(server):
    with open_ws(server) as ws:
        recv(ws)
        send(ws, {"type": "ping", "t": 12345.5})
        pong = recv(ws)
    assert pong["type"] == "pong" and pong["t"] == 12345.5 and pong["server_t"] > 0


def test_healthz_readyz_and_metrics_answer_on_the_same_port(server):
    assert server.http("/healthz")[0] == 200
    assert server.http("/readyz")[:2] == (200, "ready\n")
    status, body, headers = server.http("/metrics", AUTH)
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    for name in ("decode_ttft_seconds_bucket", "decode_inter_token_seconds_bucket", "decode_tpot_seconds_bucket",
                 "decode_e2e_seconds_bucket", "decode_prefill_seconds_bucket", "decode_prompt_tokens_total",
                 "decode_generated_tokens_total", "decode_accepted_length_bucket", "decode_busy_rejections_total",
                 'decode_requests_total{finish_reason="cancelled"}', "decode_ready 1.0"):
        assert name in body, name
    assert 'decode_ttft_seconds_bucket{le="0.0005"}' in body  # buckets start at 0.5 ms
    assert server.http("/nope")[0] == 404


def test_metrics_ask_for_the_token_when_one_is_configured_and_health_routes_never_do(server):
    status, _, headers = server.http("/metrics")
    assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert server.http("/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert server.http("/healthz")[0] == 200 and server.http("/readyz")[0] == 200


def test_metrics_count_finished_requests_and_their_tokens(server):
    def value(body, name):
        return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

    before = server.http("/metrics", AUTH)[1]
    with open_ws(server) as ws:
        recv(ws)
        generate(ws, "m", prompt(12, 6), 4)
    after = server.http("/metrics", AUTH)[1]
    assert value(after, 'decode_requests_total{finish_reason="length"}') \
        == value(before, 'decode_requests_total{finish_reason="length"}') + 1
    assert value(after, "decode_generated_tokens_total") == value(before, "decode_generated_tokens_total") + 4
    assert value(after, "decode_prompt_tokens_total") == value(before, "decode_prompt_tokens_total") + 6
    assert value(after, "decode_inter_token_seconds_count") == value(before, "decode_inter_token_seconds_count") + 3


def test_gpu_gauges_are_absent_without_a_gpu(server):
    body = server.http("/metrics", AUTH)[1]
    if "decode_gpu_" in body:
        pytest.skip("this machine has an NVIDIA GPU")
    assert "decode_gpu_" not in body


# --- auth and origins ---------------------------------------------------------------------------------


def _status(server, **kw) -> int:
    try:
        with connect(server.url, open_timeout=10, **kw) as ws:
            recv(ws)
            return 101
    except InvalidStatus as e:
        return e.response.status_code


def test_a_missing_or_wrong_token_gets_http_401_before_the_upgrade(server):
    assert _status(server, subprotocols=["decode.v1"]) == 401
    assert _status(server, additional_headers={"Authorization": "Bearer wrong"}) == 401
    assert _status(server, additional_headers={"Authorization": f"Basic {TOKEN}"}) == 401
    assert _status(server, additional_headers={"Authorization": f"Bearer {TOKEN}"}) == 101
    status, body, headers = server.http("/v1/stream")
    assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer")


def test_browsers_authenticate_with_the_bearer_subprotocol_which_is_never_selected(server):
    b64 = base64.urlsafe_b64encode(TOKEN.encode()).decode().rstrip("=")
    with connect(server.url, subprotocols=["decode.v1", f"bearer.{b64}"], open_timeout=10) as ws:
        assert ws.subprotocol == "decode.v1"
        assert recv(ws)["state"] == "ready"
    wrong = base64.urlsafe_b64encode(b"nope").decode().rstrip("=")
    assert _status(server, subprotocols=["decode.v1", f"bearer.{wrong}"]) == 401


def test_a_token_in_the_url_is_refused(server):
    try:
        connect(server.url + f"?token={TOKEN}", open_timeout=10)
        raise AssertionError("connected")
    except InvalidStatus as e:
        assert e.response.status_code == 400


def test_only_listed_browser_origins_may_connect(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert _status(server, origin="https://evil.example.com", additional_headers=auth) == 403
    assert _status(server, origin=ORIGIN, additional_headers=auth) == 101
    assert _status(server, additional_headers=auth) == 101  # scripts send no Origin



def test_a_repeated_origin_or_authorization_header_is_400_with_no_traceback(server):
    upgrade = ("GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    for extra, header in [(f"Origin: {ORIGIN}\r\nOrigin: https://evil.example.com\r\n" + auth, "Origin"),
                          (f"Origin: {ORIGIN}\r\norigin: {ORIGIN}\r\n" + auth, "Origin"),
                          (auth + "Authorization: Bearer wrong\r\n", "Authorization"),
                          (auth + auth, "Authorization")]:
        status, _, body = raw_http(server.port, (upgrade + extra + "\r\n").encode())
        assert status == 400 and f"the {header} header is sent 2 times".encode() in body, (extra, status, body)
    status, _, body = raw_http(server.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}{auth}\r\n".encode())
    assert status == 400
    status, _, _ = raw_http(server.port, (upgrade + auth + "\r\n").encode())
    assert status == 101
    assert "Traceback" not in "".join(server.lines) and "process_request failed" not in "".join(server.lines)
