"""The request loop, without threads or I/O: one request in, Engine API events out.

For each request the loop
1. validates it and turns it into token ids (text, ids, or chat messages encoded in the checkpoint's
   dialect: decode/chat.py);
2. makes the job every rank runs (plan.py): the restore of the longest prefix any tier holds (the live
   state, the prefix cache), the sampling seed, the chunk;
3. reads the job's steps from the session: progress while it prefills, then the tokens of each decode
   cycle (one token each, or a speculative block when a drafter is on), checking `cancel` between chunks
   and cycles, until max_tokens (None: the context's end), EOS or a stop string; the request's
   `TextStream` (text.py) turns the ids into what each event shows: decoded text held back at a possible
   stop string, a chat request's answer, reasoning and tool calls;
4. after its Done, tells the job to stop: the session files the conversation in the prefix cache.
Sampling values a request leaves None come from the checkpoint (generation_config.json, else the model
card: appliance.chat.sampling_defaults). The device work is the session's (session.py), the text is
text.py's; this file owns ids, events and timings.
"""

import secrets
import time
from collections.abc import Iterator

from appliance.api import Done, Error, Progress, Request, Started, Tokens
from appliance.chat import dialect_for_model, sampling_defaults
from appliance.errors import ApplianceError
from appliance.model.tokenizer import check_ids

from .chat import ChatOutput, chat_prompt
from .plan import Job
from .session import Sampled
from .text import TextStream


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

    def job(self, req: Request, ids: list[int]) -> Job:
        """Rank 0's decisions for `req`, as every rank runs it: the sampling values and seed, the restore its
        timeline plans, the chunk."""
        sampling = req.sampling.resolved(self.defaults)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        return Job(req.id, tuple(ids), sampling.temperature, sampling.top_p, sampling.top_k, seed,
                   self.session.plan(ids), self.session.chunk)

    def run(self, req: Request, cancel=None) -> Iterator:
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
        steps = self.session.run(self.job(req, ids))
        try:
            yield from self._run(req, ids, chat, steps, cancel, t0)
        except ApplianceError as e:
            self.session.reset()
            yield Error(req.id, e.code, e.message, e.field)
        finally:
            steps.close()  # a job left half way (this loop failed) is aborted on every rank

    def _run(self, req: Request, ids: list[int], chat: ChatOutput | None, steps, cancel, t0: float) -> Iterator:
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
            self._finish(req, steps)
            return
        text = TextStream(self.tokenizer, req.stop, chat)
        finish, produced, t_first = yield from self._decode(req, first, steps, text, max_tokens, cancel, t0)
        if (last := text.finish()) is not None:
            content, reasoning, calls = last
            yield Tokens(req.id, [], content, produced, [], reasoning, calls)
        usage["completion_tokens"] = produced
        end = time.perf_counter()
        spec = session.stats.as_dict() if session.spec is not None else None
        yield Done(req.id, finish, usage, _timings(t0, t_prefill, t_first, end, produced), spec,
                   stop_sequence=text.stop, prefix_cache=session.restored)
        self._finish(req, steps)  # after Done: filing the conversation is off the client's clock

    def _decode(self, req: Request, pending: list[int], steps, text: TextStream, max_tokens: int, cancel,
                t0: float):
        """Tokens events from the first tokens on, one cycle at a time, until EOS, a stop string, max_tokens
        or `cancel`; returns (finish reason, tokens produced, when the first came)."""
        eos = None if req.ignore_eos else self.cfg.eos_token_id
        produced, t_first = 0, None
        while True:
            now = time.perf_counter()
            t_first = t_first or now
            ids, ended = _until_eos(pending, eos, max_tokens - produced)
            ids, (content, reasoning, calls) = text.feed(ids)
            if ids:
                yield Tokens(req.id, ids, content, produced, [(now - t0) * 1e3] * len(ids), reasoning, calls)
            produced += len(ids)
            if ended or text.stop is not None:
                return "stop", produced, t_first
            if produced >= max_tokens:
                return "length", produced, t_first
            if cancel is not None and cancel.is_set():
                return "cancelled", produced, t_first
            pending = next(steps).tokens  # every rank runs one more cycle

    def _finish(self, req: Request, steps) -> None:
        """Rank 0 is done with the request (its Done is out): every rank stops at its next step and ends the
        job (checkpoint, file the conversation). Nothing that fails now may change the request's outcome or
        add a second terminal event: it is reported, and the live state reset."""
        self.session.stop()
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


def _until_eos(tokens: list[int], eos: int | None, room: int) -> tuple[list[int], bool]:
    """The first `room` of `tokens` up to the EOS (not kept), and whether it came."""
    for n, token in enumerate(tokens[:room]):
        if token == eos:
            return tokens[:n], True
    return tokens[:room], False
