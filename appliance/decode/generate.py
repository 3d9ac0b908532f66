"""The generation loop, without threads or I/O: one request in, Engine API events out.

A `Generator` owns one model's decode state across requests. For each request it
1. validates it and turns it into token ids (text, chat messages or ids),
2. reuses the state's longest matching token prefix (multi-turn chat) and prefills only the rest, in
   chunks, reporting progress and checking `cancel` between chunks,
3. runs decode cycles (one token each, or a speculative block when a drafter is on), checking `cancel`
   between cycles, until max_tokens, EOS or a stop string.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from appliance.api import Done, Error, Progress, Request, Sampling, Started, Tokens
from appliance.errors import ApplianceError, ContextLengthError, ModelLoadError, RequestError
from appliance.loader import LoadedModel
from appliance.model.tokenizer import StreamDecoder
from graphs.runner import make_runner
from kernels import acceptance

from .cycle import CycleBuffers, DraftStep, FixedCycle, PlainCycle, VerifyStep, reach_for, reaches
from .speculator import DraftStats, make_speculator


def render_chat(messages: list[dict], model_dir: Path, tokenizer) -> str:
    """Chat messages -> prompt text, by the checkpoint's `chat_template` (tokenizer_config.json) when it
    has one, else a plain `role: content` transcript ending with `assistant:`."""
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    if cfg_path.is_file():
        template = json.loads(cfg_path.read_text()).get("chat_template")
        if template:
            import jinja2

            env = jinja2.Environment(undefined=jinja2.StrictUndefined)
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token="", eos_token="")
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def graph_blockers(lm: LoadedModel) -> list[str]:
    """Why this model's cycle steps cannot be captured in CUDA graphs, if anything stops them: a captured
    step may not read device values on the host nor touch host memory."""
    why = []
    if lm.runtime.ops.path == "reference":
        why.append("the reference ops read values on the host (the MoE's selected experts); use --path fast")
    layers = getattr(lm.model, "layers", [])
    if any(getattr(getattr(layer, "ffn", None), "reduce", None) is not None for layer in layers):
        why.append("the expert-parallel MoE runs its reference form (the fused kernels do not expose the "
                   "per-slot partial sums the exact reduction over ranks needs), which reads the selected "
                   "experts on the host")
    for i, layer in enumerate(layers):
        table = getattr(getattr(layer, "engram", None), "table", None)
        if table is not None and table.device != lm.runtime.device:
            gb = table.numel() * table.element_size() / 1e9
            why.append(f"layer {i}'s Engram table stays in host memory ({gb:.1f} GB) and a captured step cannot "
                       "gather its rows from there yet")
    return why


class Generator:
    def __init__(self, lm: LoadedModel, capacity: int | None = None, chunk: int = 256, index_keys: str = "own",
                 spare: int = 16, draft: str = "none", draft_tokens: int = 3, graphs: bool = True,
                 reach_floor: int = 4096, notice=None):
        """With `graphs` on a CUDA device, every cycle step is captured here (see `capture`); `notice` hears
        about it first."""
        self.lm = lm
        self.model = lm.model
        self.cfg = lm.cfg
        self.capacity = capacity or self.cfg.max_context
        self.chunk = chunk
        self.index_keys = index_keys
        self.state = self.model.new_state(self.capacity, spare)
        self.eos = self.cfg.eos_token_id
        self.spec = make_speculator(self, lm, draft, draft_tokens, index_keys)
        self.keep_streams = self.spec is not None and self.spec.drafter.kind == "mtp"
        self.stats = DraftStats(draft, draft_tokens)
        self.graphs = graphs
        block = self.spec.block if self.spec is not None else 1
        self.buffers = CycleBuffers(lm.runtime.device, block, self.cfg.vocab_size)
        self.reaches = reaches(self.capacity, reach_floor)
        self.runners: dict[tuple, object] = {}
        # one memory pool for all the cycle graphs: they replay one after another on one stream, and what
        # one leaves for the next (drafts, results) lives in buffers made outside any capture
        cuda = lm.runtime.device.type == "cuda"
        if graphs and cuda and (blockers := graph_blockers(lm)):
            raise ModelLoadError("cannot capture the decode cycle in CUDA graphs: " + "; ".join(blockers)
                                 + " (or run without graphs: --no-graphs)", field="graphs")
        self.graph_pool = torch.cuda.graph_pool_handle() if graphs and cuda else None
        if self.graph_pool is not None:
            if notice is not None:
                notice(f"capturing the decode cycle as {len(self.cycle_steps())} CUDA graphs "
                       f"({len(self.reaches)} reaches up to {self.capacity} tokens)")
            self.capture()

    # --- request -> ids ------------------------------------------------------------------------------

    def prompt_ids(self, req: Request) -> list[int]:
        if req.input_ids is not None:
            ids = req.input_ids
        elif req.prompt is not None:
            ids = self.lm.tokenizer.encode(req.prompt)
        else:
            ids = self.lm.tokenizer.encode(render_chat(req.messages, self.lm.model_dir, self.lm.tokenizer))
        if not ids:
            raise RequestError("the prompt encodes to no tokens", field="prompt")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"input_ids: {len(bad)} id(s) outside the vocabulary 0..{self.cfg.vocab_size - 1} "
                               f"(first: {bad[0]})", field="input_ids", value=bad[0])
        image = getattr(self.cfg, "image_token_id", None)
        if image is not None and image in ids:
            raise RequestError(f"input_ids: image token {image} found; this server is text only",
                               field="input_ids", value=image)
        if len(ids) + req.max_tokens > self.capacity:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens} exceeds the context limit "
                f"{self.capacity}", field="max_tokens" if len(ids) < self.capacity else "prompt", value=len(ids))
        return ids

    # --- prefill ---------------------------------------------------------------------------------------

    def reusable_prefix(self, ids: list[int]) -> int:
        """Positions of the current state that the new prompt can keep: the common token prefix, at most
        len(ids) - 1 (the last prompt token is always processed, it produces the first logits)."""
        st = self.state
        n = min(st.length, len(ids) - 1)
        if n <= 0:
            return 0
        have = st.tokens[:n]
        want = torch.tensor(ids[:n], dtype=torch.long, device=have.device)
        diff = (have != want).nonzero()
        return n if diff.numel() == 0 else int(diff[0])

    def prepare(self, ids: list[int]) -> int:
        """Rewind (or reset) the state to the longest reusable prefix of `ids`; returns its length."""
        cached = self.reusable_prefix(ids)
        if cached < self.state.length:
            if cached > 0 and cached >= self.state.length - self.state.spare:
                self.state.rewind(cached)
            else:  # the rings no longer hold what a rewind that far back needs
                self.state.reset()
                cached = 0
        if self.spec is not None:
            self.spec.sync(self.state.length)
        return cached

    def prefill_chunks(self, ids: list[int], cancel=None) -> Iterator[int]:
        """Process ids[state.length:] in chunks, yielding the positions done after each chunk; stops early
        when `cancel` is set. The last chunk's logits end up in `self.logits` (None if cancelled)."""
        self.logits = None
        pos = self.state.length
        while pos < len(ids):
            if cancel is not None and cancel.is_set():
                return
            n = min(self.chunk, len(ids) - pos)
            out = self.forward_out(ids[pos:pos + n], "last")
            if self.spec is not None:
                self.spec.observe(out, pos)
            pos += n
            yield pos
        self.logits = out.logits[-1]

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Prefill without events: the logits of the last prompt position."""
        self.prepare(ids)
        for _ in self.prefill_chunks(ids):
            pass
        return self.logits

    @torch.inference_mode()
    def forward_out(self, ids: list[int], logits: str = "all"):
        tokens = torch.tensor(ids, dtype=torch.long, device=self.lm.runtime.device)
        return self.model.forward(tokens, self.state, logits=logits,
                                  index_keys=self.index_keys, keep_streams=self.keep_streams)

    def forward(self, ids: list[int], logits: str = "all") -> torch.Tensor:
        return self.forward_out(ids, logits).logits

    def runner(self, kind: str, n: int = 0, reach: int | None = None):
        """The runner of one cycle step (captured as a CUDA graph on a GPU), made on first use. `n`: the
        draft or verify width; `reach`: for the steps that run the target (cycle.py)."""
        key = (kind, n, reach)
        if key not in self.runners:
            buf = self.buffers
            step = {"plain": lambda: PlainCycle(self, buf, reach), "fixed": lambda: FixedCycle(self, buf, n, reach),
                    "draft": lambda: DraftStep(self, buf, n),
                    "verify": lambda: VerifyStep(self, buf, n, reach)}[kind]()
            self.runners[key] = make_runner(step, self.lm.runtime.device, self.graphs, pool=self.graph_pool)
        return self.runners[key]

    def cycle_steps(self) -> list[tuple[str, int, int | None]]:
        """Every cycle step this generator replays: one per verify width and reach."""
        spec = self.spec
        if spec is None:
            return [("plain", 0, r) for r in self.reaches]
        if spec.mode == "adaptive" and spec.drafter.kind == "dspark":
            return [("draft", spec.block, None)] + [("verify", w, r) for w in range(2, spec.block + 2)
                                                     for r in self.reaches]
        return [("fixed", spec.k, r) for r in self.reaches]

    @torch.inference_mode()
    def capture(self) -> None:
        """Make (on CUDA: capture) every cycle step now, at load, then reset the states: warm-up and capture
        run real cycles, and what they wrote must not survive."""
        self.start_sampling(Sampling(), 0)
        self.buffers.start.fill_(1)
        for kind, n, reach in self.cycle_steps():
            self.runner(kind, n, reach)
        self.state.reset()
        if self.spec is not None:
            self.spec.reset()

    def start_sampling(self, sampling, seed: int) -> None:
        """Per request: sampling parameters and the device RNG's seed (its counter restarts at 0)."""
        buf = self.buffers
        buf.params.copy_(torch.tensor([sampling.temperature, sampling.top_p, float(sampling.top_k)]))
        buf.key.copy_(torch.tensor([seed, 0]))

    def sample_first(self, logits: torch.Tensor) -> int:
        return int(acceptance.sample(logits.unsqueeze(0), self.buffers.params, self.buffers.key)[0])

    @torch.inference_mode()
    def cycle(self, token: int) -> list[int]:
        """Process `token` at the next position and return the tokens that follow it: one without a drafter;
        the accepted drafts and one more with one. One cycle = one replay and one small copy back."""
        buf, spec = self.buffers, self.spec
        N = self.state.length
        buf.anchor.fill_(token)
        buf.start.fill_(N)
        if spec is None:
            result = self.runner("plain", 0, reach_for(self.reaches, N + 1)).run()["result"]
            drafted = 0
        else:
            buf.force.fill_(-1 if spec.force_accept is None else spec.force_accept)
            if spec.mode == "adaptive" and spec.drafter.kind == "dspark":
                confidence = self.runner("draft", spec.block).run()["confidence"]
                drafted = spec.adaptive_length(confidence.cpu())
                result = self.runner("verify", drafted + 1, reach_for(self.reaches, N + drafted + 1)).run()["result"]
            else:
                drafted = spec.k
                result = self.runner("fixed", spec.k, reach_for(self.reaches, N + spec.k + 1)).run()["result"]
        values = result.tolist()
        count, accepted = values[0], values[1]
        self.state.advance(count)
        if spec is not None:
            spec.state.advance(count)
            self.stats.record(drafted, accepted)
        return values[2:2 + count]

    # --- the loop ------------------------------------------------------------------------------------

    @torch.inference_mode()  # no autograd bookkeeping: about a fifth of a tiny model's decode step on CPU
    def run(self, req: Request, cancel=None) -> Iterator:
        t0 = time.perf_counter()
        try:
            req.validate()
            ids = self.prompt_ids(req)
        except ApplianceError as e:
            yield Error(req.id, e.code, e.message, e.field)
            return
        try:
            yield from self._run(req, ids, cancel, t0)
        except ApplianceError as e:
            self.state.reset()
            yield Error(req.id, e.code, e.message, e.field)

    def _run(self, req: Request, ids: list[int], cancel, t0: float) -> Iterator:
        cached = self.prepare(ids)
        yield Started(req.id, len(ids), cached)
        seed = req.sampling.seed if req.sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        if self.lm.world is not None:  # every rank samples with rank 0's seed
            seed = self.lm.world.broadcast(seed)
        self.start_sampling(req.sampling, seed)
        for done in self.prefill_chunks(ids, cancel):
            if done < len(ids):
                yield Progress(req.id, done, len(ids), (time.perf_counter() - t0) * 1e3)
        logits = self.logits
        t_prefill = time.perf_counter()
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": cached}
        if logits is None:
            yield Done(req.id, "cancelled", usage, self._timings(t0, t_prefill, None, t_prefill, 0))
            return
        self.stats = DraftStats(self.stats.draft, self.stats.k)
        decoder = StreamDecoder(self.lm.tokenizer)
        produced: list[int] = []
        t_first = None
        finish = "length"
        text_so_far = ""
        pending = [self.sample_first(logits)]
        while finish == "length":
            now = time.perf_counter()
            t_first = t_first or now
            ids, piece = [], ""
            for token in pending:
                if token == self.eos and not req.ignore_eos:
                    finish = "stop"
                    break
                ids.append(token)
                text = decoder.push([token])
                stop_at = _find_stop(text_so_far + piece + text, req.stop, len(text_so_far) + len(piece))
                if stop_at is not None:
                    piece = (text_so_far + piece + text)[len(text_so_far):stop_at]
                    finish = "stop"
                    break
                piece += text
                if len(produced) + len(ids) >= req.max_tokens:
                    break
            if ids or piece:
                yield Tokens(req.id, ids, piece, len(produced), [(now - t0) * 1e3] * len(ids))
            produced += ids
            text_so_far += piece
            if finish != "length" or len(produced) >= req.max_tokens:
                break
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            pending = self.cycle(pending[-1])
        tail = decoder.flush() if finish != "stop" or not req.stop else ""
        if tail:
            yield Tokens(req.id, [], tail, len(produced), [])
        usage["completion_tokens"] = len(produced)
        end = time.perf_counter()
        spec = self.stats.as_dict() if self.spec is not None else None
        yield Done(req.id, finish, usage, self._timings(t0, t_prefill, t_first, end, len(produced)), spec)

    @staticmethod
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


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop string starts, if one ends in the new part of `text`."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
