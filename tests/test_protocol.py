"""decode.v1 without a network: frames fed to the parser, events turned into frames, seq numbering, limits,
the error mapping, and the pre-upgrade gate (auth, origins, paths)."""

import base64

import orjson
import pytest
from multidict import CIMultiDict

from appliance.api import ChatRequest, Done, Error, Progress, Request, Started, Tokens
from server import gate
from server import protocol as proto
from server.protocol import Cancel, Generate, Ping, ProtocolError

LIMITS = proto.Limits.for_engine(4096, 512)


def parse(obj):
    return proto.parse(obj if isinstance(obj, str) else orjson.dumps(obj).decode(), LIMITS)


def test_a_generate_frame_becomes_an_engine_request_with_every_field():
    cmd = parse({"type": "generate", "id": "r1", "input_ids": [1, 2, 3], "max_tokens": 7,
                 "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3}, "stop": ["\n"],
                 "ignore_eos": True, "timings": "per_token"})
    assert isinstance(cmd, Generate)
    r = cmd.request
    assert isinstance(r, Request) and r.id == "r1" and r.input_ids == [1, 2, 3] and r.max_tokens == 7
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed) == (0.7, 0.9, 40, 3)
    assert r.stop == ["\n"] and r.ignore_eos and r.timings == "per_token"


def test_cancel_and_ping_frames_parse_with_and_without_their_optional_fields():
    assert parse({"type": "cancel", "id": "r1"}) == Cancel("r1")
    assert parse({"type": "cancel"}) == Cancel(None)
    assert parse({"type": "ping", "t": 1.5}) == Ping(1.5)
    assert parse({"type": "ping"}) == Ping(None)


@pytest.mark.parametrize("frame, field, code", [
    ("not json", "message", "invalid_request"),
    ('"a string"', "message", "invalid_request"),
    ({"type": "dance"}, "type", "invalid_request"),
    ({"type": "generate", "input_ids": [1], "max_tokens": 9000}, "max_tokens", "invalid_request"),
    ({"type": "generate", "input_ids": [1], "max_tokens": True}, "max_tokens", "invalid_request"),
    ({"type": "generate", "input_ids": [1], "sampling": {"temperature": 2.5}}, "sampling.temperature",
     "invalid_request"),
    ({"type": "generate", "input_ids": [1], "sampling": {"seed": -1}}, "sampling.seed", "invalid_request"),
    ({"type": "generate", "input_ids": [512]}, "input_ids", "invalid_request"),
    ({"type": "generate", "input_ids": [1] * 4096}, "input_ids", "context_length_exceeded"),
    ({"type": "generate", "id": "", "input_ids": [1]}, "id", "invalid_request"),
    ({"type": "generate", "id": "x" * 129, "input_ids": [1]}, "id", "invalid_request"),
    ({"type": "generate", "input_ids": [1], "extra": 1}, "extra", "invalid_request"),
    ({"type": "cancel", "id": "a", "why": "bored"}, "why", "invalid_request"),
])
def test_bad_frames_raise_an_error_naming_the_field(frame, field, code):
    with pytest.raises(ProtocolError) as e:
        parse(frame)
    assert (e.value.field, e.value.code) == (field, code)
    assert e.value.close_code is None


def test_error_messages_name_the_field_the_value_and_the_fix():
    with pytest.raises(ProtocolError) as e:
        parse({"type": "generate", "input_ids": [1], "max_tokens": 0})
    assert e.value.message == "max_tokens=0: must be an integer in 1..4095"  # the context (4096) less one prompt token
    with pytest.raises(ProtocolError) as e:
        parse({"type": "generate", "id": "q", "input_ids": [1], "sampling": {"temperature": 9}})
    assert "temperature=9" in e.value.message and "0..2" in e.value.message
    frame = proto.error_for(e.value)
    assert frame == {"type": "error", "id": "q", "error": {"type": "invalid_request_error", "code": "invalid_request",
                                                           "message": e.value.message, "param": "sampling.temperature"},
                     "retryable": False}


def test_integers_beyond_64_bits_still_reach_the_range_check_of_their_field():
    with pytest.raises(ProtocolError) as e:
        parse('{"type": "generate", "input_ids": [1], "max_tokens": 123456789012345678901234567890}')
    assert e.value.field == "max_tokens"


def test_an_oversize_message_asks_for_close_1009_and_binary_frames_are_refused():
    big = "x" * (LIMITS.max_message_bytes + 1)
    with pytest.raises(ProtocolError) as e:
        proto.parse(big, LIMITS)
    assert e.value.close_code == proto.CLOSE_TOO_BIG == 1009
    with pytest.raises(ProtocolError) as e:
        proto.parse(b'{"type": "ping"}', LIMITS)
    assert e.value.field == "message" and e.value.close_code is None


def test_limits_derive_the_message_size_from_the_context_so_a_full_prompt_fits():
    limits = proto.Limits.for_engine(855_000, 129280)
    full_prompt = orjson.dumps({"type": "generate", "input_ids": [129279] * 854_999, "max_tokens": 1})
    assert len(full_prompt) < limits.max_message_bytes
    assert limits.max_tokens == 854_999 and proto.Limits.for_engine(100, 10).max_tokens == 99  # no cap but the context
    assert LIMITS.as_dict() == {"max_context": 4096, "max_tokens": 4095,
                                "max_message_bytes": proto.max_message_bytes(4096), "vocab_size": 512}


def test_frames_carry_a_strictly_increasing_seq_starting_at_one():
    frames = proto.Frames()
    out = [orjson.loads(frames.encode(f)) for f in (proto.hello("ready", "m", "1", LIMITS), proto.pong(1, 2.0),
                                                    proto.queued(3))]
    assert [f["seq"] for f in out] == [1, 2, 3]
    assert [f["type"] for f in out] == ["hello", "pong", "queued"]
    assert out[0]["protocol"] == "decode.v1" and out[0]["limits"]["vocab_size"] == 512


def test_runs_of_token_events_merge_into_one_delta_keeping_index_and_every_t_ms():
    events = [Started("r", 5, 2), Progress("r", 3, 5, 1.0), Tokens("r", [7], "a", 0, [10.0]),
              Tokens("r", [8, 9], "bc", 1, [12.5, 13.0]), Tokens("r", [], "!", 3, []),
              Done("r", "length", {"prompt_tokens": 5, "completion_tokens": 3, "cached_tokens": 2},
                   {"ttft_ms": 10.0123456}, {"draft": "dspark", "mean_accepted": 2.5})]
    frames = proto.event_frames(events, "per_token")
    assert [f["type"] for f in frames] == ["started", "progress", "delta", "done"]
    assert frames[2] == {"type": "delta", "id": "r", "index": 0, "text": "abc!", "token_ids": [7, 8, 9],
                         "t_ms": [10.0, 12.5, 13.0]}
    assert frames[3]["timings"] == {"ttft_ms": 10.012} and frames[3]["speculative"]["mean_accepted"] == 2.5
    final = proto.event_frames(events, "final")
    assert "t_ms" not in final[2] and "timings" in final[3]
    assert "timings" not in proto.event_frames(events, "none")[3]


def test_engine_errors_map_to_protocol_codes_and_unknown_codes_become_internal():
    frame = proto.event_frames([Error("r", "context_length_exceeded", "too long", "input_ids")])[0]
    assert frame["error"] == {"type": "invalid_request_error", "code": "context_length_exceeded",
                              "message": "too long", "param": "input_ids"}
    odd = proto.error_frame("state", "rewind past the ring", request_id="r")
    assert odd["error"]["code"] == "internal" and odd["error"]["message"].startswith("state: ")
    busy = proto.error_frame("busy", "one user", retry_after_ms=250.7)
    assert busy["retryable"] is True and busy["retry_after_ms"] == 250 and "id" not in busy


# --- the gate before the upgrade -----------------------------------------------------------------------


def Headers(*maps, **kw) -> CIMultiDict:
    """Request headers as aiohttp hands them to the gate."""
    out = CIMultiDict()
    for m in (*maps, kw):
        out.extend(m)
    return out


def test_the_token_is_accepted_from_the_bearer_header_or_the_bearer_subprotocol_only():
    tok = "abc-123_XYZ"
    b64 = base64.urlsafe_b64encode(tok.encode()).decode().rstrip("=")
    assert gate.authorized(Headers(), None)
    assert gate.authorized(Headers({"Authorization": f"Bearer {tok}"}), tok)
    assert gate.authorized(Headers({"authorization": f"bearer {tok}"}), tok)
    assert gate.authorized(Headers({"Sec-WebSocket-Protocol": f"decode.v1, bearer.{b64}"}), tok)
    assert not gate.authorized(Headers(), tok)
    assert not gate.authorized(Headers({"Authorization": f"Bearer {tok}x"}), tok)
    assert not gate.authorized(Headers({"Authorization": f"Token {tok}"}), tok)
    assert not gate.authorized(Headers({"Sec-WebSocket-Protocol": "decode.v1, bearer.!!!"}), tok)
    assert gate.select_subprotocol(["decode.v1", f"bearer.{b64}"]) == "decode.v1"
    assert gate.select_subprotocol([f"bearer.{b64}"]) is None


def test_the_gate_answers_404_400_403_401_in_that_order_and_lets_the_rest_upgrade():
    ok = Headers({"Authorization": "Bearer t"})
    assert gate.check_upgrade("/elsewhere", ok, "t", ()).status == 404
    assert gate.check_upgrade("/v1/stream?token=t", ok, "t", ()).status == 400
    assert gate.check_upgrade("/v1/stream", Headers(ok, Origin="https://x.example"), "t", ()).status == 403
    assert gate.check_upgrade("/v1/stream", Headers(Origin="https://x.example"), "t",
                              ("https://x.example",)).status == 401
    assert gate.check_upgrade("/v1/stream", Headers(ok, Origin="https://x.example/"), "t",
                              ("https://x.example",)).status is None
    assert gate.check_upgrade("/v1/stream", Headers(Origin="https://any.example"), None, ("*",)).status is None
    assert gate.check_upgrade("/v1/stream", Headers(), None, ()).status is None


def test_a_token_file_must_hold_one_word(tmp_path):
    from appliance.errors import ApplianceError

    f = tmp_path / "token"
    f.write_text("  s3cret\n")
    assert gate.read_token(f) == "s3cret"
    for bad in ("", "two words"):
        f.write_text(bad)
        with pytest.raises(ApplianceError, match="--token-file"):
            gate.read_token(f)
    with pytest.raises(ApplianceError, match="cannot read"):
        gate.read_token(tmp_path / "missing")


# --- the JSON policy: what orjson cannot write back is refused at the door ------------------------------


@pytest.mark.parametrize("text, field", [
    (r'{"type": "generate", "id": "\ud800", "prompt": "a", "max_tokens": 2}', "id"),
    (r'{"type": "generate", "id": "ok", "prompt": "a\udfff", "max_tokens": 2}', "prompt"),
    (r'{"type": "generate", "messages": [{"role": "user", "content": "x\ud83d"}]}', "messages[0].content"),
    (r'{"type": "generate", "input_ids": [1], "stop": ["a", "\udc00"]}', "stop[1]"),
    (r'{"type": "generate", "input_ids": [1], "\ud800": 1}', "\\ud800"),
    (r'{"type": "cancel", "id": "\ud800"}', "id"),
    ('{"type": "ping", "t": ' + "7" * 400 + "}", "t"),
    ('{"type": "ping", "t": -1e400}', "t"),
    ('{"type": "ping", "t": NaN}', "t"),
    ('{"type": "ping", "t": Infinity}', "t"),
    ('{"type": "generate", "input_ids": [1], "sampling": {"temperature": 1e999}}', "sampling.temperature"),
    ('{"type": "generate", "input_ids": [1, ' + "9" * 5000 + "]}", "input_ids[1]"),
])
def test_values_orjson_cannot_write_back_are_invalid_requests_naming_their_field(text, field):
    with pytest.raises(ProtocolError) as e:
        proto.parse(text, LIMITS)
    assert (e.value.code, e.value.field) == ("invalid_request", field), e.value.message
    assert e.value.message.startswith(field) and len(e.value.message) < 300
    orjson.dumps(proto.error_for(e.value))  # the error itself can always be written


def test_a_refused_generate_keeps_its_own_id_when_that_id_is_valid():
    with pytest.raises(ProtocolError) as e:
        proto.parse(r'{"type": "generate", "id": "r7", "prompt": "\ud800"}', LIMITS)
    assert e.value.request_id == "r7" and proto.error_for(e.value)["id"] == "r7"
    with pytest.raises(ProtocolError) as e:
        proto.parse(r'{"type": "generate", "id": "\ud800", "prompt": "a"}', LIMITS)
    assert e.value.request_id is None


def test_a_ping_echoes_64_bit_integers_and_refuses_what_orjson_reads_as_a_double_beyond_them():
    assert parse('{"type": "ping", "t": 18446744073709551615}') == Ping(2**64 - 1)
    assert parse('{"type": "ping", "t": -9223372036854775808}') == Ping(-(2**63))
    for beyond in ("18446744073709551616", "-9223372036854775809e10", "1.9e19"):
        with pytest.raises(ProtocolError) as e:
            parse('{"type": "ping", "t": ' + beyond + "}")
        assert e.value.field == "t"
    pong = orjson.loads(proto.Frames().encode(proto.pong(2**64 - 1, 1.0)))
    assert pong["t"] == 2**64 - 1


def test_nesting_is_answered_with_a_short_message_at_any_depth():
    for depth in (1000, 1023):  # Python's repr gives up near 1000; orjson reads 1024 levels (the object is one)
        with pytest.raises(ProtocolError) as e:
            parse('{"type": "ping", "t": ' + "[" * depth + "]" * depth + "}")
        assert e.value.field == "t" and len(e.value.message) < 200
    with pytest.raises(ProtocolError) as e:
        parse('{"type": "ping", "t": ' + "[" * 1024 + "]" * 1024 + "}")
    assert e.value.field == "message" and "malformed JSON" in e.value.message
    with pytest.raises(ProtocolError) as e:
        parse('{"type": "generate", "id": ' + "[" * 1000 + "]" * 1000 + ', "input_ids": [1]}')
    assert e.value.field == "id"


def test_control_characters_are_valid_text_and_reach_the_request():
    cmd = parse(r'{"type": "generate", "prompt": "a\u0000b\u001f\n", "stop": ["\u0007"]}')
    assert cmd.request.prompt == "a\x00b\x1f\n" and cmd.request.stop == ["\x07"]


def test_a_frame_that_cannot_be_encoded_becomes_an_internal_error_for_its_request_and_keeps_the_seq_order():
    frames = proto.Frames()
    bad = [{"type": "done", "id": "r1", "usage": {"x": object()}}, {"type": "delta", "id": "\ud800", "text": "a"},
           {"type": "pong", "t": 2**70}, {"type": "started", "id": "r2", "prompt_tokens": float("nan") * 1j}]
    for i, frame in enumerate(bad, start=1):
        text, why = frames.encode_checked(frame)
        out = orjson.loads(text)
        assert why and out["seq"] == i and out["type"] == "error" and out["error"]["code"] == "internal"
        assert frame["type"] in out["error"]["message"]
    assert orjson.loads(frames.encode_checked(bad[0])[0])["id"] == "r1"
    assert orjson.loads(frames.encode_checked(bad[1])[0])["id"] == "\\ud800"
    assert frames.encode_checked(proto.pong(1, 2.0)) == ('{"type":"pong","seq":7,"t":1,"server_t":2.0}', None)
    assert frames.try_encode(bad[0])[0] is None and frames.seq == 7  # no seq taken: the caller decides


def test_the_engine_api_refuses_text_that_is_not_unicode_so_the_tokenizer_never_sees_it():
    from appliance.errors import RequestError

    chat = ChatRequest([{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}])
    for req, field in [(Request(prompt="ab\ud800"), "prompt"), (Request(id="\udfff", input_ids=[1]), "id"),
                       (Request(chat=chat), "messages[1].content"),
                       (Request(input_ids=[1], stop=["\ud800"]), "stop[0]")]:
        with pytest.raises(RequestError) as e:
            req.validate()
        assert (e.value.code, e.value.field) == ("invalid_request", field)
        assert "lone surrogate '\\ud" in e.value.message or "lone surrogate '\\udfff'" in e.value.message
    Request(prompt="emoji \U0001f600 and \x00 are text").validate()


# --- the gate: methods, repeated headers ------------------------------------------------------------------


def MultiHeaders(pairs=()) -> CIMultiDict:
    """Headers from (name, value) pairs: a name may repeat, as on the wire."""
    return CIMultiDict(pairs)


def test_methods_other_than_get_and_head_get_405_naming_the_allowed_ones():
    for path in gate.HTTP_ROUTES:
        assert gate.check_method("GET", path).status is None and gate.check_method("HEAD", path).status is None
        for method in ("DELETE", "PUT", "POST", "OPTIONS", "TRACE", "PATCH", "BREW"):
            v = gate.check_method(method, path)
            assert (v.status, v.allow) == (405, ("GET", "HEAD")) and method in v.text
    assert gate.check_method("GET", "/v1/stream").status is None
    assert gate.check_method("HEAD", "/v1/stream").allow == ("GET",)
    assert gate.check_method("DELETE", "/elsewhere").status is None  # left to its 404


def test_a_repeated_origin_or_authorization_header_is_400_naming_it():
    two_origins = MultiHeaders([("Origin", "https://a.example"), ("origin", "https://b.example")])
    v = gate.check_upgrade("/v1/stream", two_origins, None, ("*",))
    assert v.status == 400 and "Origin header is sent 2 times" in v.text
    two_tokens = MultiHeaders([("Authorization", "Bearer t"), ("Authorization", "Bearer u")])
    assert gate.check_upgrade("/v1/stream", two_tokens, "t", ()).status == 400
    assert gate.check_token(two_tokens, "t").status == 400
    assert gate.check_upgrade("/v1/stream", two_tokens, None, ()).status is None  # no token: never read
    assert gate.check_upgrade("//[", MultiHeaders(), None, ()).status == 404  # urllib would raise here
