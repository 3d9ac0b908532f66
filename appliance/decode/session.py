"""The device side of decoding: one mutable inference timeline.

A `DecodeSession` owns the target's decode state, the speculator (the drafter and its state), the cycle
buffers, the graph set of cycle steps and the timeline (timeline.py: the ids the state holds, its
checkpoints and the prefix cache). A request reaches it as a `Job` (plan.py: ids, sampling, seed, the
restore rank 0 planned) and `run(job)` publishes it (rank 0) and does the device work, on every rank alike:
    restore the planned prefix; the ranks compare what they did        -> Restored(cached)
    the sampling parameters and the device RNG's seed
    prefill the rest in chunks, asking rank 0's word before each       -> Prefilled(done) per chunk
    sample the first token, then decode cycles, asking before each      -> Sampled(tokens) per cycle
    checkpoint and file the conversation in the prefix cache (or reset, for the warm-up)
Rank 0's request loop (loop.py) reads the steps, owns ids, stops, text and events, and says `stop()` when
its request is done; the followers run the jobs rank 0 publishes (`follow`) and read nothing. What crosses
the ranks (the job with its seed, rank 0's word, an adaptive draft's length) crosses here, through the
job's `Steer` (plan.py). Nothing here knows a request.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from appliance.errors import ModelLoadError, RankDivergence
from appliance.options import RunOptions
from graphs.graph_set import GraphSet
from kernels.registry import long_calls

from .checkpoint import ring_buffers, to_host
from .cycle import CycleBuffers, DraftStep, FixedCycle, PlainCycle, Target, VerifyStep, reach_for, reaches
from .plan import COLD, Aborted, Job, Restore, Steer, Unavailable, agreement, crc, gather, gather_objects
from .prefix_cache import PrefixCache
from .prefix_disk import DiskTier, Layout, fingerprint
from .speculator import DraftStats, make_speculator
from .timeline import Timeline

SPARE = 16  # positions a state can rewind without re-prefilling (the rings' slack)


@dataclass
class Restored:
    cached: int  # prompt positions kept (not prefilled)


@dataclass
class Prefilled:
    done: int  # prompt positions processed so far


@dataclass
class Sampled:
    tokens: list[int]  # the tokens a step produced (the first token, or a cycle's)


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
        self.notice = notice or (lambda m: None)
        self.check_ranks = options.check_ranks  # compare every rank's whole live state after each job
        self.chunk = options.chunk
        self.state = self.model.new_state(self.capacity, spare)
        self.spec = make_speculator(lm.drafter, options.draft, options.draft_tokens, options.index_keys,
                                    self.model, self.state)
        self.timeline = Timeline(self.state, self.spec, options.checkpoint_stride,
                                 self._prefix_cache(lm, options, notice), notice)
        self.stats = DraftStats(options.draft, options.draft_tokens)
        keep_streams = self.spec is not None and self.spec.drafter.kind == "mtp"
        self.target = Target(self.model, self.state, lm.runtime.ops, options.index_keys, keep_streams)
        spec = self.spec
        rings = {} if spec is None else {"rows_ring": spec.rows.size, "window_ring": spec.window_ring()}
        self.buffers = CycleBuffers(self.device, spec.block if spec else 1, self.cfg.vocab_size, **rings)
        self.reaches = reaches(self.capacity, reach_floor)
        self.graphs = GraphSet(self.device, options.graphs, check_inputs=check_graph_inputs)
        if self.graphs.capturing and lm.capture_blockers:
            raise ModelLoadError("cannot capture the decode cycle in CUDA graphs: " + "; ".join(lm.capture_blockers)
                                 + " (or run without graphs: --no-graphs)", field="graphs")
        self.logits: torch.Tensor | None = None
        self._steer: Steer | None = None  # the running job's (run)
        self._warming = False  # jobs are warm-ups (warming)
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
        self.buffers.load(0, 1)
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
            try:
                disk = DiskTier(root, fingerprint(lm.model_dir, run, layout), layout,
                                int(options.prefix_cache_disk_gb * 1e9), notice)
                cache.attach_disk(disk)
            except Exception as e:  # noqa: BLE001 - best effort: a directory that cannot be used is no reason to stop
                cache.disk = None
                (notice or print)(f"prefix cache: cannot use --prefix-cache-dir {root} ({type(e).__name__}: {e}); "
                                  "cached conversations stay in host memory only")
        return cache

    @property
    def disk_errors(self) -> dict[str, int]:
        """The disk tier's failed operations by kind (read, write, evict, scan); empty without one."""
        cache = self.timeline.cache
        return dict(cache.disk.errors) if cache is not None and cache.disk is not None else {}

    def reset(self) -> None:
        """Back to an empty state (a cold start); the prefix cache keeps what it has."""
        self.timeline.reset()

    def prepare(self, ids: list[int]) -> int:
        """Restore the longest prefix of `ids` that the live state, its checkpoints or the prefix cache hold
        (at most len(ids) - 1: the last prompt id always runs, it produces the first logits), deciding here:
        one rank, benchmarks and tests. Returns its length; what it did is in `self.timeline.last`."""
        return self.timeline.prepare(ids)

    # --- jobs: the same steps on every rank ---------------------------------------------------------

    def plan(self, ids: list[int]) -> Restore:
        """Rank 0's (or the one rank's) choice of how a job restores the longest cached prefix of `ids`."""
        return self.timeline.plan(ids)

    def run(self, job: Job) -> Iterator[Restored | Prefilled | Sampled]:
        """Run `job` (module docstring); on rank 0 it is published first, so every rank runs it, a warm-up's
        (`warming`) marked to leave nothing behind. Every step a caller reads is followed, before any other
        collective, by rank 0's word through the job's `Steer`, so rank 0 can stop the followers (`stop`) or
        abort them wherever its loop is: closing the steps early (rank 0's loop failed) aborts the job on
        every rank and resets the state."""
        if self._warming:
            job = replace(job, commit=False, reset=True)
        self._steer = Steer(self.world)
        return self._steps(job, self._steer)

    def stop(self) -> None:
        """Rank 0 is done with the running job (its last token is out): every rank stops at its next step
        and ends the job."""
        self._steer.stop()

    @contextmanager
    def warming(self):
        """The jobs run inside are warm-ups: real jobs end to end that leave nothing behind on any rank (not
        filed in the prefix cache, the live state reset at their end)."""
        self._warming = True
        try:
            yield
        finally:
            self._warming = False

    def _steps(self, job: Job, steer: Steer) -> Iterator[Restored | Prefilled | Sampled]:
        world = self.world
        if world is not None and world.distributed and world.main:
            world.publish(job)
        try:
            yield Restored(self.begin(job))
            self.start_sampling_params(job.temperature, job.top_p, job.top_k, job.seed)
            yield from (Prefilled(done) for done in self.prefill(list(job.ids), steer.proceed, job.chunk))
            if self.logits is not None:
                tokens = [self.sample_first(self.logits)]
                yield Sampled(tokens)
                while steer.proceed():
                    tokens = self.cycle(tokens[-1], steer)
                    yield Sampled(tokens)
        except GeneratorExit:
            if steer.main:
                steer.abort_followers()
            self.reset()
            raise
        except RankDivergence as e:
            if e.field != "collective":
                self.reset()
                raise
            said = gather_objects(self.world, self._describe())  # every rank is here: name their plans too
            self.reset()
            raise RankDivergence(f"{e.message}, in rank 0's {said[0]}; rank {e.value}'s {said[e.value]}",
                                 field=e.field, value=e.value) from None
        except Aborted:
            self.reset()
            raise
        self.end(job)

    def follow(self) -> None:
        """Ranks 1..n-1: run every job rank 0 publishes until it publishes None. Between jobs they wait
        without a timeout (the user may pause for hours). A job that rank 0 aborts, or in which the ranks
        diverged, ends here too: the state is reset and the next job runs."""
        world = self.world
        while (job := world.next_job()) is not None:
            try:
                for _ in self.run(job):
                    pass
            except (Aborted, RankDivergence):
                pass

    def begin(self, job: Job) -> int:
        """Carry out the job's restore; when any rank cannot (a cache file it could not write or read), every
        rank starts from the empty state instead. Then the ranks compare what they did."""
        try:
            cached, missing = self.timeline.execute(list(job.ids), job.restore), ""
        except Unavailable as e:
            cached, missing = 0, str(e)
        if any(row[0] for row in gather(self.world, [int(bool(missing))])):
            for r, why in enumerate(gather_objects(self.world, missing)):
                if why:
                    self.notice(f"prefix cache (rank {r}): cannot restore {job.restore.how} at "
                                f"{job.restore.landed}: {why}; starting from the empty state")
            cached = self.timeline.execute(list(job.ids), COLD)
        agreement(self.world, self._plan_digest, self._describe)
        return cached

    def end(self, job: Job) -> None:
        """The job's end: checkpoint and file the conversation (job.commit), or back to the empty state
        (job.reset); with --check-ranks every rank's whole live state is compared."""
        self.timeline.commit(file=job.commit)
        if job.reset:
            self.reset()
        if self.check_ranks:
            try:
                agreement(self.world, self.state_digest, lambda: f"job {self.world.jobs}: state digest "
                                                                    f"{self.state_digest()}")
            except RankDivergence:
                self.reset()
                raise

    def _plan_digest(self) -> list[int]:
        """What the ranks compare after a restore: the job's number, the restore carried out, the lengths
        and the ids the state holds."""
        draft = self.spec.state.length if self.spec is not None else -1
        return [self.world.jobs, crc(repr(self.timeline.executed).encode()), self.timeline.executed.landed,
                self.state.length, draft, crc(self.state.tokens[:self.state.length])]

    def _describe(self) -> str:
        draft = self.spec.state.length if self.spec is not None else None
        return (f"job {self.world.jobs}: {self.timeline.executed}, state length {self.state.length}, drafter "
                f"length {draft}")

    def state_digest(self) -> list[int]:
        """Checksums of everything a reader of the live state can reach (ids, rings, rows; the drafter's
        too): equal on every rank when their states are."""
        buffers = dict(self.state.live_buffers())
        if self.spec is not None:
            buffers.update({f"draft.{k}": t for k, t in self.spec.state.live_buffers().items()})
        out = [self.state.length]
        for name in sorted(buffers):
            raw = buffers[name].contiguous().view(torch.uint8).reshape(-1)
            weights = torch.arange(raw.numel(), device=raw.device) % 251 + 1
            out.append(int((raw.long() * weights).sum()) & 0x7FFFFFFFFFFF)
        return out

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
        """End of a request run without a job (benchmarks, tests): checkpoint the state and file the
        conversation in the prefix cache."""
        self.timeline.commit()

    # --- prefill -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: list[int], proceed: Callable[[], bool] | None = None,
                chunk: int | None = None) -> Iterator[int]:
        """Process ids[state.length:] in chunks of `chunk` (default: the session's), yielding the positions
        done after each chunk; stops early when `proceed()`, asked before each chunk, says no. The last
        chunk's logits end up in `self.logits` (None if stopped)."""
        self.logits = None
        pos = self.state.length
        last = None
        chunk = chunk or self.chunk
        points = self.timeline.cut_points(pos, len(ids))  # checkpoints there, inside a chunk or at its end
        while pos < len(ids):
            if proceed is not None and not proceed():
                return
            end = min(pos + chunk, len(ids))
            if end - pos <= self.state.spare:  # a short call's kernels write the rings before attending: no taps
                end = min(end, next(c for c in points if c > pos))
            inside = [c for c in points if pos < c < end]
            # a chunk's products run as a long call's, whatever its size: the prompt's bits do not depend on
            # its chunks (kernels/_triton.py LONG_ROWS)
            with self.state.committing(end), self.state.tapping(inside, to_host) as taps, long_calls():
                out = self.forward_out(ids[pos:end], "last")
            self.timeline.extend(ids[pos:end])
            for a, b in zip([pos, *inside], [*inside, end]):
                if self.spec is not None:
                    with self.spec.state.committing(b), long_calls():
                        self.spec.observe(out, pos, (a, b))
                if b < end:
                    self.timeline.checkpoint(b, taps.rings[b])
            last, out = out.logits[-1], None  # the chunk's outputs go before the next chunk makes its own
            pos = end
            if pos in points:
                self.timeline.checkpoint()
            yield pos
        self.logits = last

    def prefill_all(self, ids: list[int]) -> torch.Tensor:
        """Prepare and prefill without events: the logits of the last prompt position."""
        self.prepare(ids)
        for _ in self.prefill(ids):
            pass
        return self.logits

    @torch.inference_mode()
    def forward_out(self, ids: list[int], logits: str = "all"):
        """An eager forward over `ids` at the state's length (prefill, tests, benchmarks)."""
        return self.target.forward(torch.tensor(ids, dtype=torch.long, device=self.device), logits)

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
    def cycle(self, token: int, steer: Steer | None = None) -> list[int]:
        """Process `token` at the next position and return the tokens that follow it: one without a drafter;
        the accepted drafts and one more with one. One cycle = one replay and one small copy back (an
        adaptive draft: two, and the length rank 0 picks, shared through `steer`)."""
        buf, spec = self.buffers, self.spec
        N = self.state.length
        if spec is None:
            buf.load(token, N)
            result = self.graphs.run(("plain", 0, reach_for(self.reaches, N + 1)))["result"]
            drafted = 0
        else:
            spec.catch_up(N)
            buf.load(token, N, -1 if spec.force_accept is None else spec.force_accept)
            if spec.adaptive:
                confidence = self.graphs.run(("draft", spec.block, None))["confidence"]
                drafted = spec.adaptive_length(confidence.cpu())
                if steer is not None:  # it shapes the verify's collectives: rank 0's length on every rank
                    drafted = steer.shared(drafted)
                reach = reach_for(self.reaches, N + drafted + 1)
                result = self.graphs.run(("verify", drafted + 1, reach))["result"]
            else:
                drafted = spec.k
                result = self.graphs.run(("fixed", spec.k, reach_for(self.reaches, N + spec.k + 1)))["result"]
        values = result.tolist()
        count, accepted = values[0], values[1]
        self.state.advance(count)
        if spec is not None:
            spec.cycled(count)
            self.stats.record(drafted, accepted)
        tokens = values[2:2 + count]
        self.timeline.extend([token] + tokens[:-1])  # what the cycle processed: the anchor, accepted drafts
        if self.timeline.crossed_stride(N):
            self.timeline.checkpoint()
        return tokens
