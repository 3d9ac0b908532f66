"""The latency probe: one user, sequential requests over decode.v1, timed on the client.

For each request the client stamps the send, every token's arrival and the `done`. When the server merged
several tokens into one `delta` (a slow reader), only the last token's arrival is observed; the earlier
ones are dated back by the server's per-token `t_ms` differences, so inter-token gaps stay exact and add
up to the real elapsed time. Warm-up requests run first and are left out of every statistic.

Exit conditions become `ProbeError(exit_code)`: 4 when the box is busy or not ready, 5 when the server
cannot be reached (or drops the connection), 2 for what the user must fix (token, URL).
"""

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from server.protocol import CLOSE_TRY_AGAIN, PROTOCOL

EXIT_SLO = 3
EXIT_BUSY = 4
EXIT_UNREACHABLE = 5


class ProbeError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@dataclass
class RequestRecord:
    """One measured request. Times in ms from the client's send, except the per-request rates."""

    index: int
    warmup: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    ttft_ms: float | None = None
    t2t_ms: float | None = None  # time to the second token
    server_ttft_ms: float | None = None  # engine queue + server TTFT, from done.timings
    overhead_ms: float | None = None  # client TTFT - server TTFT: network, websocket and host time
    tpot_ms: float | None = None  # first token excluded
    tokens_per_s: float | None = None  # per user, first token excluded
    max_stall_ms: float | None = None
    e2e_ms: float | None = None
    accepted_length: float | None = None  # speculative: mean accepted tokens per cycle, from done
    delta_frames: int = 0
    progress_frames: int = 0
    token_ms: list[float] = field(default_factory=list)  # each token's (back-dated) arrival
    itl_ms: list[float] = field(default_factory=list)
    gaps: str = "token"  # itl_ms between tokens, or between arrivals of chunks holding several ("arrival")

    def as_dict(self, with_tokens: bool = True) -> dict:
        d = asdict(self)
        if not with_tokens:
            d.pop("token_ms")
            d.pop("itl_ms")
        return d


@dataclass
class ProbeConfig:
    url: str = "ws://127.0.0.1:8765/v1/stream"
    requests: int = 20
    warmup: int = 2
    isl: int | None = 128
    osl: int = 128
    prompt: str | None = None  # text prompt instead of random ids
    ignore_eos: bool = True  # fixed output length (always on with random ids)
    token: str | None = None
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class ProbeRun:
    config: ProbeConfig
    hello: dict
    records: list[RequestRecord]

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


def build_request(cfg: ProbeConfig, vocab_size: int, rng: random.Random, i: int) -> dict:
    """Random ids within the announced vocabulary with `ignore_eos`, so prompt and output lengths are
    exact; or the text prompt."""
    req = {"type": "generate", "id": f"probe-{i}", "max_tokens": cfg.osl, "timings": "per_token",
           "sampling": {"temperature": 0.0}}
    if cfg.prompt is not None:
        req["prompt"] = cfg.prompt
        req["ignore_eos"] = cfg.ignore_eos
    else:
        req["input_ids"] = [rng.randrange(vocab_size) for _ in range(cfg.isl)]
        req["ignore_eos"] = True
    return req


async def _recv(ws, timeout_s: float) -> tuple[dict, float]:
    msg = await asyncio.wait_for(ws.recv(), timeout_s)
    return orjson.loads(msg), time.perf_counter()


async def _open(cfg: ProbeConfig):
    headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else None
    try:
        ws = await asyncio.wait_for(connect(cfg.url, subprotocols=[PROTOCOL], additional_headers=headers,
                                            compression=None, max_size=None, open_timeout=10), 15)
    except InvalidURI as e:
        raise ProbeError(f"{cfg.url}: not a websocket URL ({e}); e.g. ws://127.0.0.1:8765/v1/stream", 2) from None
    except InvalidStatus as e:
        status = e.response.status_code
        body = e.response.body.decode(errors="replace").strip() if e.response.body else ""
        if status == 401:
            raise ProbeError(f"{cfg.url}: HTTP 401 unauthorized: pass the server's token with --token-file", 2) \
                from None
        if status == 503:
            raise ProbeError(f"{cfg.url}: HTTP 503 ({body}): the server is not accepting connections", EXIT_BUSY) \
                from None
        raise ProbeError(f"{cfg.url}: HTTP {status} {body}", 2) from None
    except (OSError, TimeoutError, InvalidHandshake) as e:
        raise ProbeError(f"{cfg.url}: unreachable ({type(e).__name__}: {e})", EXIT_UNREACHABLE) from None
    hello, _ = await _recv(ws, 10)
    if hello.get("state") != "ready":
        retry = ""
        try:
            err, _ = await _recv(ws, 5)
            retry = f"; retry in {err.get('retry_after_ms')} ms" if err.get("retry_after_ms") else ""
        except (ConnectionClosed, TimeoutError):
            pass
        await ws.close()
        raise ProbeError(f"{cfg.url}: the box is {hello.get('state')} (one user per box){retry}", EXIT_BUSY)
    return ws, hello


async def measure_one(ws, req: dict, index: int, warmup: bool, timeout_s: float) -> RequestRecord:
    rec = RequestRecord(index, warmup)
    t0 = time.perf_counter()
    await ws.send(orjson.dumps(req).decode())
    arrivals: list[float] = []
    server_ms: list[float] = []
    while True:
        f, t = await _recv(ws, timeout_s)
        kind = f.get("type")
        if kind == "delta":
            ids = f.get("token_ids") or []
            if not ids:
                continue
            rec.delta_frames += 1
            tm = f.get("t_ms")
            if tm and len(tm) == len(ids):
                arrivals += [t - (tm[-1] - x) / 1e3 for x in tm]
                server_ms += tm
            else:
                arrivals += [t] * len(ids)
        elif kind == "progress":
            rec.progress_frames += 1
        elif kind == "done":
            _finish(rec, f, t0, t, arrivals)
            return rec
        elif kind == "error":
            err = f.get("error", {})
            code = err.get("code")
            raise ProbeError(f"request {req.get('id')}: {code}: {err.get('message')}",
                             EXIT_BUSY if code in ("busy", "not_ready") else 1)


def _finish(rec: RequestRecord, done: dict, t0: float, t_done: float, arrivals: list[float]) -> None:
    usage, timings = done.get("usage", {}), done.get("timings") or {}
    rec.finish_reason = done.get("finish_reason", "")
    record_arrivals(rec, t0, t_done, arrivals, usage, len(arrivals))
    if timings.get("ttft_ms") is not None:
        rec.server_ttft_ms = (timings.get("queue_ms") or 0.0) + timings["ttft_ms"]
        if rec.ttft_ms is not None:
            rec.overhead_ms = rec.ttft_ms - rec.server_ttft_ms
    spec = done.get("speculative") or {}
    rec.accepted_length = spec.get("mean_accepted")


def record_arrivals(rec: RequestRecord, t0: float, t_done: float, arrivals: list[float], usage: dict,
                    tokens: int) -> None:
    """The client-side times of one request from when its output arrived (`arrivals`, perf_counter seconds;
    one per token on decode.v1, one per chunk of `tokens` in all over an SSE stream)."""
    rec.prompt_tokens = usage.get("prompt_tokens", 0)
    rec.output_tokens = usage.get("completion_tokens", len(arrivals))
    rec.e2e_ms = (t_done - t0) * 1e3
    rec.token_ms = [(a - t0) * 1e3 for a in arrivals]
    rec.itl_ms = [b - a for a, b in zip(rec.token_ms, rec.token_ms[1:])]
    rec.gaps = "token" if len(arrivals) == rec.output_tokens else "arrival"
    if rec.token_ms:
        rec.ttft_ms = rec.token_ms[0]
    if len(rec.token_ms) >= 2:
        rec.t2t_ms = rec.token_ms[1]
        span = rec.token_ms[-1] - rec.token_ms[0]
        n = max(tokens, len(rec.token_ms))
        rec.tpot_ms = span / (n - 1)
        rec.tokens_per_s = (n - 1) / (span / 1e3) if span > 0 else None
        rec.max_stall_ms = max(rec.itl_ms)


async def run_probe(cfg: ProbeConfig, on_request=None) -> ProbeRun:
    """Warm-up then measured requests on one connection, one at a time. `on_request(record)` after each."""
    ws, hello = await _open(cfg)
    vocab = (hello.get("limits") or {}).get("vocab_size")
    if cfg.prompt is None and not vocab:
        await ws.close()
        raise ProbeError("the server's hello carries no limits.vocab_size: use --prompt-file", 2)
    rng = random.Random(cfg.seed)
    records = []
    try:
        for i in range(cfg.warmup + cfg.requests):
            req = build_request(cfg, vocab, rng, i)
            rec = await measure_one(ws, req, i, i < cfg.warmup, cfg.timeout_s)
            records.append(rec)
            if on_request is not None:
                on_request(rec)
    except ConnectionClosed as e:
        code = e.rcvd.code if e.rcvd else None
        if code == CLOSE_TRY_AGAIN:
            raise ProbeError(f"{cfg.url}: closed with 1013 (busy or not ready)", EXIT_BUSY) from None
        raise ProbeError(f"{cfg.url}: connection lost (close code {code})", EXIT_UNREACHABLE) from None
    except TimeoutError:
        raise ProbeError(f"{cfg.url}: no frame for {cfg.timeout_s:g} s", EXIT_UNREACHABLE) from None
    finally:
        await ws.close()
    return ProbeRun(cfg, hello, records)
