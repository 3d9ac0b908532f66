"""The device side of decoding: one mutable inference timeline.

A `DecodeSession` owns the target's decode state, the speculator (the drafter and its state), the cycle
buffers, the graph set of cycle steps and the timeline (timeline.py: the ids the state holds, its
checkpoints and the prefix cache). Its calls, in the order a request makes them:
    cached = session.prepare(ids)            restore the longest prefix any tier holds
    for done in session.prefill(ids, cancel): ...   the rest in chunks; `session.logits` after the last
    session.start_sampling(sampling, seed)   per request: parameters and the device RNG's seed
    token = session.sample_first(logits)
    tokens = session.cycle(token)            one decode cycle: one replay, one small copy back
    session.finish()                         checkpoint and file the conversation in the prefix cache
The request loop (loop.py) owns ids, stops, text and events; nothing here knows a request.
"""

from collections.abc import Iterator

import torch

from appliance.errors import ModelLoadError
from appliance.options import RunOptions
from graphs.graph_set import GraphSet

from .checkpoint import ring_buffers
from .cycle import CycleBuffers, DraftStep, FixedCycle, PlainCycle, Target, VerifyStep, reach_for, reaches
from .prefix_cache import PrefixCache
from .prefix_disk import DiskTier, Layout, fingerprint
from .speculator import DraftStats, make_speculator
from .timeline import Timeline

SPARE = 16  # positions a state can rewind without re-prefilling (the rings' slack)


class DecodeSession:
    def __init__(self, lm, options: RunOptions, capacity: int | None = None, reach_floor: int = 4096,
                 notice=None, check_graph_inputs: bool = False, spare: int = SPARE):
        """`lm`: a loaded model (appliance.loader.LoadedModel); `capacity`: positions the state holds (the
        model's maximum by default); `spare`: positions a ring keeps beyond what its readers reach (journal
        rewinds, and the reach of a checkpoint). With graphs on a CUDA device every cycle step is captured
        here; `notice` hears about it first (and about prefix-cache files it does not use)."""
        self.model, self.cfg, self.world = lm.model, lm.cfg, lm.world
        self.device = lm.runtime.device
        self.capacity = capacity or self.cfg.max_context
        self.chunk = options.chunk
        self.index_keys = options.index_keys
        self.state = self.model.new_state(self.capacity, spare)
        self.spec = make_speculator(lm.drafter, options.draft, options.draft_tokens, options.index_keys,
                                    self.model, self.state)
        self.timeline = Timeline(self.state, self.spec, options.checkpoint_stride,
                                 self._prefix_cache(lm, options, notice), notice)
        self.stats = DraftStats(options.draft, options.draft_tokens)
        keep_streams = self.spec is not None and self.spec.drafter.kind == "mtp"
        self.target = Target(self.model, self.state, lm.runtime.ops, options.index_keys, keep_streams)
        self.buffers = CycleBuffers(self.device, self.spec.block if self.spec else 1, self.cfg.vocab_size)
        self.reaches = reaches(self.capacity, reach_floor)
        self.graphs = GraphSet(self.device, options.graphs, check_inputs=check_graph_inputs)
        if self.graphs.capturing and lm.capture_blockers:
            raise ModelLoadError("cannot capture the decode cycle in CUDA graphs: " + "; ".join(lm.capture_blockers)
                                 + " (or run without graphs: --no-graphs)", field="graphs")
        self.logits: torch.Tensor | None = None
        if self.graphs.capturing and notice is not None:
            notice(f"capturing the decode cycle as {len(self.cycle_steps())} CUDA graphs "
                   f"({len(self.reaches)} reaches up to {self.capacity} tokens)")
        self.build_steps()

    # --- cycle steps ---------------------------------------------------------------------------------

    def cycle_steps(self) -> list[tuple[str, int, int | None]]:
        """Every cycle step this session replays, keyed (kind, draft or verify width, reach)."""
        spec = self.spec
        if spec is None:
            return [("plain", 0, r) for r in self.reaches]
        if spec.adaptive:
            return [("draft", spec.block, None)] + [("verify", w, r) for w in range(2, spec.block + 2)
                                                     for r in self.reaches]
        return [("fixed", spec.k, r) for r in self.reaches]

    def _step(self, kind: str, n: int, reach: int | None):
        t, spec, buf = self.target, self.spec, self.buffers
        if kind == "plain":
            return PlainCycle(t, buf, reach)
        if kind == "fixed":
            return FixedCycle(t, spec, buf, n, reach)
        if kind == "draft":
            return DraftStep(spec, buf, n)
        return VerifyStep(t, spec, buf, n, reach)

    @torch.inference_mode()
    def build_steps(self) -> None:
        """Make (on CUDA: capture) every cycle step, then reset the states: warm-up and capture run real
        cycles, and what they wrote must not survive."""
        self.start_sampling_params(0.0, 1.0, 0, 0)
        self.buffers.start.fill_(1)
        steps = {key: self._step(*key) for key in self.cycle_steps()}
        self.graphs.build(steps, size=lambda key: (key[1], key[2] or 0))
        self.reset()

    # --- state ---------------------------------------------------------------------------------------

    def _prefix_cache(self, lm, options: RunOptions, notice) -> PrefixCache | None:
        """The host tier (None with --prefix-cache-gb 0) and, with --prefix-cache-dir, its disk tier."""
        if options.prefix_cache_gb <= 0:
            return None
        cache = PrefixCache(int(options.prefix_cache_gb * 1e9), {n: r.ratio for n, r in self.state.rows.items()},
                            notice)
        if options.prefix_cache_dir is not None:
            draft_state = self.spec.state if self.spec is not None else None
            layout = Layout({n: (tuple(t.shape), t.dtype) for n, t in ring_buffers(self.state, draft_state).items()},
                            {n: (r.ratio, r.data.shape[1], r.data.dtype) for n, r in self.state.rows.items()},
                            self.state.spare)
            world = self.world
            rank, size = (world.rank, world.size) if world is not None and world.distributed else (0, 1)
            run = {"numerics": options.numerics, "dtype": options.dtype, "path": lm.runtime.ops.path,
                   "index_keys": options.index_keys, "drafter": self.spec.drafter.kind if self.spec else "none",
                   "rank": rank, "ranks": size}
            root = options.prefix_cache_dir / f"rank{rank}" if size > 1 else options.prefix_cache_dir
            disk = DiskTier(root, fingerprint(lm.model_dir, run, layout), layout,
                            int(options.prefix_cache_disk_gb * 1e9), notice)
            cache.attach_disk(disk)
        return cache

    def reset(self) -> None:
        """Back to an empty state (a cold start); the prefix cache keeps what it has."""
        self.timeline.reset()

    def prepare(self, ids: list[int]) -> int:
        """Restore the longest prefix of `ids` that the live state, its checkpoints or the prefix cache hold
        (at most len(ids) - 1: the last prompt id always runs, it produces the first logits); returns its
        length. What it did is in `self.timeline.last`."""
        return self.timeline.prepare(ids)

    def rewind(self, position: int) -> int:
        """Back to `position` of the current ids, from any tier, prefilling what the nearest checkpoint
        lacks; returns the positions restored without prefill."""
        ids = self.timeline.history[:position]
        landed = self.timeline.rewind(position)
        for _ in self.prefill(ids):
            pass
        return landed

    @property
    def restored(self) -> dict:
        """What the last prepare restored (Done.prefix_cache): source, matched_tokens, cached_tokens,
        restored_bytes, restore_ms."""
        return dict(self.timeline.last)

    def finish(self) -> None:
        """End of a request: checkpoint the state and file the conversation in the prefix cache."""
        self.timeline.commit()

    # --- prefill -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: list[int], cancel=None) -> Iterator[int]:
        """Process ids[state.length:] in chunks, yielding the positions done after each chunk; stops early
        when `cancel` is set. The last chunk's logits end up in `self.logits` (None if cancelled)."""
        self.logits = None
        pos = self.state.length
        out = None
        cuts = self.timeline.cut_points(pos, len(ids))  # chunks end there, and a checkpoint is taken
        while pos < len(ids):
            if cancel is not None and cancel.is_set():
                return
            n = min(self.chunk, next(c for c in cuts if c > pos) - pos)
            out = self.forward_out(ids[pos:pos + n], "last")
            if self.spec is not None:
                self.spec.observe(out, pos)
            self.timeline.extend(ids[pos:pos + n])
            pos += n
            if pos in cuts:
                self.timeline.checkpoint()
            yield pos
        if out is not None:
            self.logits = out.logits[-1]

    def prefill_all(self, ids: list[int]) -> torch.Tensor:
        """Prepare and prefill without events: the logits of the last prompt position."""
        self.prepare(ids)
        for _ in self.prefill(ids):
            pass
        return self.logits

    @torch.inference_mode()
    def forward_out(self, ids: list[int], logits: str = "all"):
        """An eager forward over `ids` at the state's length (prefill, tests, benchmarks)."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model.forward(tokens, self.state, logits=logits, index_keys=self.index_keys,
                                  keep_streams=self.target.keep_streams)

    def forward(self, ids: list[int], logits: str = "all") -> torch.Tensor:
        return self.forward_out(ids, logits).logits

    # --- decode --------------------------------------------------------------------------------------

    def start_sampling(self, sampling, seed: int) -> None:
        """Per request: sampling parameters (appliance.api.Sampling) and the device RNG's seed (its counter
        restarts at 0)."""
        self.start_sampling_params(sampling.temperature, sampling.top_p, sampling.top_k, seed)
        self.stats = DraftStats(self.stats.draft, self.stats.k)

    def start_sampling_params(self, temperature: float, top_p: float, top_k: int, seed: int) -> None:
        buf = self.buffers
        buf.params.copy_(torch.tensor([temperature, top_p, float(top_k)]))
        buf.key.copy_(torch.tensor([seed, 0]))

    @torch.inference_mode()
    def sample_first(self, logits: torch.Tensor) -> int:
        return int(self.target.ops.sample(logits.unsqueeze(0), self.buffers.params, self.buffers.key)[0])

    @torch.inference_mode()
    def cycle(self, token: int) -> list[int]:
        """Process `token` at the next position and return the tokens that follow it: one without a drafter;
        the accepted drafts and one more with one. One cycle = one replay and one small copy back."""
        buf, spec = self.buffers, self.spec
        N = self.state.length
        buf.anchor.fill_(token)
        buf.start.fill_(N)
        if spec is None:
            result = self.graphs.run(("plain", 0, reach_for(self.reaches, N + 1)))["result"]
            drafted = 0
        else:
            buf.force.fill_(-1 if spec.force_accept is None else spec.force_accept)
            if spec.adaptive:
                confidence = self.graphs.run(("draft", spec.block, None))["confidence"]
                drafted = spec.adaptive_length(confidence.cpu())
                reach = reach_for(self.reaches, N + drafted + 1)
                result = self.graphs.run(("verify", drafted + 1, reach))["result"]
            else:
                drafted = spec.k
                result = self.graphs.run(("fixed", spec.k, reach_for(self.reaches, N + spec.k + 1)))["result"]
        values = result.tolist()
        count, accepted = values[0], values[1]
        self.state.advance(count)
        if spec is not None:
            spec.state.advance(count)
            self.stats.record(drafted, accepted)
        tokens = values[2:2 + count]
        self.timeline.extend([token] + tokens[:-1])  # what the cycle processed: the anchor, accepted drafts
        if self.timeline.crossed_stride(N):
            self.timeline.checkpoint()
        return tokens
