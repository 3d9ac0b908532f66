"""The request loop, without threads or I/O: one request in, Engine API events out.

For each request the loop
1. validates it and turns it into token ids (text, ids, or chat messages encoded in the checkpoint's
   dialect: decode/chat.py);
2. makes the job every rank runs (plan.py): the restore of the longest prefix any tier holds (the live
   state, the prefix cache), the sampling seed, the chunk;
3. reads the job's steps from the session: progress while it prefills, then the tokens of each decode
   cycle (one token each, or a speculative block when a drafter is on), checking `cancel` between chunks
   and cycles, until max_tokens (None: the context's end), EOS or a stop string, turning ids into text as
   it goes; a chat request's text goes through its output parser (answer, reasoning, tool calls);
4. after its Done, tells the job to stop: the session files the conversation in the prefix cache.
Stop strings match the model's text as decoded, markup included. Sampling values a request leaves None come
from the checkpoint (generation_config.json, else the model card: appliance.chat.sampling_defaults).
The device work is the session's (session.py); this file owns ids, stops, text, events and timings.
"""

import secrets
import time
from collections.abc import Iterator

from appliance.api import Done, Error, Progress, Request, Started, Tokens
from appliance.chat import dialect_for_model, sampling_defaults
from appliance.errors import ApplianceError
from appliance.model.tokenizer import StreamDecoder, check_ids

from .chat import ChatOutput, chat_prompt
from .plan import Job, Steer
from .session import Sampled


class RequestLoop:
    def __init__(self, session, tokenizer, model_dir=None):
        """`session`: a DecodeSession; `tokenizer`: the model's (appliance.model.tokenizer); `model_dir`:
        where generation_config.json may live."""
        self.session = session
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.cfg = session.cfg
        self.dialect = dialect_for_model(self.cfg.family, has_dspark=self.cfg.dspark is not None)
        self.defaults = sampling_defaults(model_dir, self.dialect)

    def prompt_ids(self, req: Request) -> tuple[list[int], ChatOutput | None]:
        """The prompt's ids, checked against the vocabulary and the context, and for a chat request the
        parser of its output."""
        ids, chat = self.encode(req)
        check_ids(ids, self.cfg, self.session.capacity, reserve=req.max_tokens or 1)
        return ids, chat

    def encode(self, req: Request) -> tuple[list[int], ChatOutput | None]:
        """The prompt's ids as given or encoded (no limit checked), and for a chat request the parser of its
        output. Only the tokenizer and the chat encoder: safe on any thread."""
        if req.input_ids is not None:
            return req.input_ids, None
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt), None
        return chat_prompt(req, self.dialect, self.tokenizer)

    def job(self, req: Request, ids: list[int], warmup: bool = False) -> Job:
        """Rank 0's decisions for `req`, as every rank runs it: the sampling values and seed, the restore its
        timeline plans, the chunk; a warm-up leaves nothing behind (not filed in the prefix cache, the live
        state reset at its end)."""
        sampling = req.sampling.resolved(self.defaults)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        return Job(req.id, tuple(ids), sampling.temperature, sampling.top_p, sampling.top_k, seed,
                   self.session.plan(ids), self.session.chunk, commit=not warmup, reset=warmup)

    def run(self, req: Request, cancel=None, warmup: bool = False) -> Iterator:
        """The request's events. On several ranks this is rank 0's: its job runs on every rank (the
        followers in `DecodeSession.follow`). `cancel` (an Event or None) is read between chunks and cycles."""
        t0 = time.perf_counter()
        try:
            req.validate()
            ids, chat = self.prompt_ids(req)
        except ApplianceError as e:
            yield Error(req.id, e.code, e.message, e.field)
            return
        except Exception as e:  # a defect between a request and its ids: no device work began, the state stays
            yield Error(req.id, "internal", f"the request could not be encoded ({type(e).__name__}: {e}); the "
                        "decode state is kept")
            return
        steer = Steer(self.session.world)
        steps = self.session.run(self.job(req, ids, warmup), steer)
        try:
            yield from self._run(req, ids, chat, steps, steer, cancel, t0)
        except ApplianceError as e:
            self.session.reset()
            yield Error(req.id, e.code, e.message, e.field)
        finally:
            steps.close()  # a job left half way (this loop failed) is aborted on every rank

    def _run(self, req: Request, ids: list[int], chat: ChatOutput | None, steps, steer: Steer, cancel,
             t0: float) -> Iterator:
        session = self.session
        max_tokens = req.max_tokens or session.capacity - len(ids)
        cached = next(steps).cached
        yield Started(req.id, len(ids), cached)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": cached}
        first = yield from _prefill(req.id, len(ids), steps, cancel, t0)
        t_prefill = time.perf_counter()
        if first is None:
            yield Done(req.id, "cancelled", usage, _timings(t0, t_prefill, None, t_prefill, 0),
                       prefix_cache=session.restored)
            self._finish(req, steps, steer)
            return
        decoder = StreamDecoder(self.tokenizer)
        produced: list[int] = []
        t_first = None
        finish = "length"
        text_so_far = ""  # emitted
        held = ""  # decoded but not emitted: it may be the start of a stop string
        matched = None
        pending = first
        while finish == "length":
            now = time.perf_counter()
            t_first = t_first or now
            ids, piece = [], ""
            for token in pending:
                if token == self.cfg.eos_token_id and not req.ignore_eos:
                    finish = "stop"
                    break
                ids.append(token)
                held += decoder.push([token])
                stop_at, matched = _find_stop(text_so_far + piece + held, req.stop, len(text_so_far) + len(piece))
                if stop_at is not None:
                    piece = (text_so_far + piece + held)[len(text_so_far):stop_at]
                    held, finish = "", "stop"
                    break
                keep = _stop_prefix(held, req.stop)
                piece, held = piece + held[:len(held) - keep], held[len(held) - keep:]
                if len(produced) + len(ids) >= max_tokens:
                    break
            if ids or piece:
                yield _tokens(req.id, ids, piece, len(produced), [(now - t0) * 1e3] * len(ids), chat)
            produced += ids
            text_so_far += piece
            if finish != "length" or len(produced) >= max_tokens:
                break
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            pending = next(steps).tokens  # every rank runs one more cycle
        tail = held + decoder.flush() if matched is None else ""  # after a stop string nothing more is text
        if chat is not None:
            content, reasoning, calls = chat.finish(tail)
            if content or reasoning or calls:
                yield Tokens(req.id, [], content, len(produced), [], reasoning, calls)
        elif tail:
            yield Tokens(req.id, [], tail, len(produced), [])
        usage["completion_tokens"] = len(produced)
        end = time.perf_counter()
        spec = session.stats.as_dict() if session.spec is not None else None
        yield Done(req.id, finish, usage, _timings(t0, t_prefill, t_first, end, len(produced)), spec,
                   stop_sequence=matched, prefix_cache=session.restored)
        self._finish(req, steps, steer)  # after Done: filing the conversation is off the client's clock

    def _finish(self, req: Request, steps, steer: Steer) -> None:
        """Rank 0 is done with the request (its Done is out): every rank stops at its next step and ends the
        job (checkpoint, file the conversation). Nothing that fails now may change the request's outcome or
        add a second terminal event: it is reported, and the live state reset."""
        steer.stop()
        try:
            for _ in steps:
                pass
        except ApplianceError as e:
            self.session.reset()
            self.session.notice(f"after request {req.id!r} ended: {e.message}")


def _prefill(rid: str, total: int, steps, cancel, t0: float):
    """Progress events while the job prefills; returns the first tokens, or None when `cancel` was set (the
    job then stops before its next chunk)."""
    while cancel is None or not cancel.is_set():
        step = next(steps)
        if isinstance(step, Sampled):
            return step.tokens
        if step.done < total:
            yield Progress(rid, step.done, total, (time.perf_counter() - t0) * 1e3)
    return None


def _tokens(rid: str, ids: list[int], piece: str, index: int, t_ms: list[float], chat: ChatOutput | None) -> Tokens:
    if chat is None:
        return Tokens(rid, ids, piece, index, t_ms)
    content, reasoning, calls = chat.feed(piece)
    return Tokens(rid, ids, content, index, t_ms, reasoning, calls)


def _timings(t0, t_prefill, t_first, end, n) -> dict:
    decode_ms = (end - t_first) * 1e3 if t_first else 0.0
    return {
        "queue_ms": 0.0,
        "prefill_ms": (t_prefill - t0) * 1e3,
        "ttft_ms": (t_first - t0) * 1e3 if t_first else None,
        "decode_ms": decode_ms,
        "tpot_ms": decode_ms / (n - 1) if n > 1 else None,
        "tokens_per_s": (n - 1) / (decode_ms / 1e3) if n > 1 and decode_ms > 0 else None,
        "e2e_ms": (end - t0) * 1e3,
    }


def _stop_prefix(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (held back until they cannot)."""
    for k in range(min(len(text), max(map(len, stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int | None, str | None]:
    """(index where the earliest stop string starts, that string), if one ends in the new part of `text`."""
    best, which = None, None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best, which = i, s
    return best, which
