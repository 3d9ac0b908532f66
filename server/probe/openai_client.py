"""The latency probe over an OpenAI-compatible API (`appliance probe --api openai`): one user, sequential
streaming chat completions (`stream: true`, `stream_options.include_usage`), timed on the client, so this
box and any other server (vLLM, SGLang) are measured by one tool with the same metrics and SLO gate.

What differs from decode.v1 (server/probe/client.py): OpenAI's stream has no per-token server times, so
each chunk that carries output (content, reasoning_content or a tool call) is one arrival, stamped when it
is read; `output_tokens` and `prompt_tokens` come from the final usage chunk; TPOT is (last arrival - first)
/ (output_tokens - 1), as vLLM's benchmark computes it; there is no server TTFT (nor the overhead beside
it) and no acceptance length. Inter-token gaps are per token when every arrival carried one token (as many
arrivals as output tokens); otherwise a chunk held several and the gaps are between arrivals, which the
report says (`gaps: arrival`).

`--isl N` is N prompt tokens as the server counts them (its `usage.prompt_tokens`, chat template
included): before the warm-up the probe calibrates a bag of random common words with one-token requests
until the count is N (`calibrate`), then every request sends those words in a new order (the same count,
and no prefix the server could reuse past the first word). `ignore_eos` (a vLLM extension this box takes
too) makes the output length exact.
"""

import random
import time

import aiohttp
import orjson

from .client import EXIT_BUSY, EXIT_UNREACHABLE, ProbeConfig, ProbeError, ProbeRun, RequestRecord, record_arrivals

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def base_url(url: str) -> str:
    """`host:port`, `http://host:port` or `.../v1` -> the API root (`http://host:port/v1`)."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    host, _, path = rest.partition("/")
    path = path.rstrip("/")
    if path in ("", "v1/stream"):
        path = "v1"
    return f"{scheme}://{host}/{path}"


FILLERS = ("a", "I", "x", "o")  # short words that fine-tune a count by one token
CALIBRATION_STEPS = 24


def build_body(cfg: ProbeConfig, model: str, rng: random.Random, words: list[str] | None = None) -> dict:
    """A streamed request of the prompt file, or of `words` (the calibrated bag) in a random order after the
    first."""
    if cfg.prompt is not None:
        text = cfg.prompt
    else:
        rest = words[1:]
        rng.shuffle(rest)
        text = " ".join(words[:1] + rest)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": cfg.osl,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def prompt_tokens(http, url: str, model: str, words: list[str]) -> int:
    """The server's count of a one-message prompt of `words` (a one-token request)."""
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": 1}
    async with http.post(url, json=body) as r:
        if r.status != 200:
            raise _fail_status(url, r.status, await r.text())
        return int((await r.json())["usage"]["prompt_tokens"])


async def calibrate(http, url: str, model: str, isl: int, rng: random.Random) -> list[str]:
    """A bag of words whose prompt the server counts as exactly `isl` tokens (the template's own tokens
    included): grown or shrunk by the measured difference, then by short fillers, one request a step."""
    words = [rng.choice(WORDS) for _ in range(max(1, isl // 2))]
    for _ in range(CALIBRATION_STEPS):
        n = await prompt_tokens(http, url, model, words)
        if n == isl:
            return words
        if n < isl:
            more = isl - n
            words += [rng.choice(FILLERS if more <= 2 else WORDS) for _ in range(max(1, more // 2))]
        elif len(words) > 1:
            del words[-max(1, (n - isl) // 2):]
            if len(words) == 0:
                words = [rng.choice(FILLERS)]
        else:
            break
    raise ProbeError(f"--isl {isl}: cannot build a prompt of exactly {isl} tokens on this server (the chat "
                     f"template alone may be longer: the shortest prompt counted {n}); use --prompt-file", 2)


def _fail_status(url: str, status: int, text: str) -> ProbeError:
    if status == 401:
        return ProbeError(f"{url}: HTTP 401 unauthorized: pass the server's token with --token-file", 2)
    if status in (429, 503):
        return ProbeError(f"{url}: HTTP {status} ({text.strip()[:200]}): the box is busy or not ready", EXIT_BUSY)
    return ProbeError(f"{url}: HTTP {status} {text.strip()[:300]}", 2 if 400 <= status < 500 else 1)


async def _model(http: aiohttp.ClientSession, root: str) -> tuple[str, str]:
    """(the first model /v1/models lists, the Server header)."""
    async with http.get(root + "/models") as r:
        if r.status != 200:
            raise _fail_status(root + "/models", r.status, await r.text())
        data = await r.json()
        models = data.get("data") or []
        if not models:
            raise ProbeError(f"{root}/models lists no model", 2)
        return models[0]["id"], r.headers.get("Server", "")


async def measure_one(http, url: str, body: dict, index: int, warmup: bool, timeout_s: float) -> RequestRecord:
    rec = RequestRecord(index, warmup)
    arrivals: list[float] = []
    t0 = time.perf_counter()
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(sock_read=timeout_s)) as r:
        if r.status != 200:
            raise _fail_status(url, r.status, await r.text())
        usage = None
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            t = time.perf_counter()
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise ProbeError(f"request {index}: {chunk['error'].get('message')}", 1)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                        or delta.get("tool_calls"):
                    arrivals.append(t)
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    usage = usage or {}
    record_arrivals(rec, t0, time.perf_counter(), arrivals, usage,
                    usage.get("completion_tokens", len(arrivals)))
    return rec


async def run_openai_probe(cfg: ProbeConfig, on_request=None) -> ProbeRun:
    """Warm-up then measured requests, one at a time, on one keep-alive connection."""
    root = base_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
    rng = random.Random(cfg.seed)
    records = []
    try:
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=1)) as http:
            model, server = await _model(http, root)
            url = root + "/chat/completions"
            words = await calibrate(http, url, model, cfg.isl, rng) if cfg.prompt is None else None
            for i in range(cfg.warmup + cfg.requests):
                body = build_body(cfg, model, rng, words)
                rec = await measure_one(http, url, body, i, i < cfg.warmup, cfg.timeout_s)
                records.append(rec)
                if on_request is not None:
                    on_request(rec)
    except (aiohttp.ClientConnectionError, OSError) as e:
        raise ProbeError(f"{root}: unreachable ({type(e).__name__}: {e})", EXIT_UNREACHABLE) from None
    except TimeoutError:
        raise ProbeError(f"{root}: no answer for {cfg.timeout_s:g} s", EXIT_UNREACHABLE) from None
    return ProbeRun(cfg, {"model": model, "server_version": server, "api": "openai"}, records)
