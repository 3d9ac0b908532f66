"""What the live decode state holds and how to get any prefix back: the ids it has processed, its
checkpoints (checkpoint.py), and the prefix cache of earlier conversations behind it (prefix_cache.py, with
its disk tier prefix_disk.py). Three tiers, tried in this order for the longest prefix of a new prompt:
- the device state in use: the journal rewinds the last `spare` positions exactly; further back, the
  nearest checkpoint (the live state keeps its rows and ids);
- host memory: the rows of the cached path and one checkpoint are copied into the live state;
- disk: the same, after reading the files into host memory.

Choosing and doing are apart: `plan` reads the tiers and returns a `Restore` (plan.py), `execute` carries one
out. On several ranks rank 0 plans and every rank executes its plan with its own tiers (a rank never
decides from its own caches); `prepare` does both in one process.

A restore lands on a checkpoint position c (or on the prompt's match p itself when a checkpoint sits in
[p, p + spare]); the session then prefills ids[c:] as usual, so `cached_tokens` is exactly the number of
prompt positions not prefilled. Checkpoints are taken during prefill at every multiple of the stride, at
the match point p when the restore landed before it (a branch point: the next branch there is free), at
the end of the prompt, during decoding at every multiple of the stride, and at the end of every request,
when the conversation is committed to the prefix cache. A prefill chunk is not cut at a checkpoint: one
inside it is made from the rings the chunk writes (state.RingTaps) and the drafter observing the chunk up
to it, bit for bit what a chunk ending there would have left.

Restores write into the existing state tensors (copy_, fill_, zero_): no buffer is rebound, so captured
CUDA graphs replay on valid addresses.
"""

import time

import torch

from . import checkpoint as ckpt
from .plan import COLD, Restore, Unavailable
from .prefix_cache import Match, PrefixCache
from .prefix_disk import CacheFileError


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return n if diff.numel() == 0 else int(diff[0])


class Timeline:
    def __init__(self, state, spec, stride: int, cache: PrefixCache | None = None, notice=None):
        """`state`: the target's DecodeState; `spec`: the speculator or None; `stride`: positions between
        checkpoints (0: no checkpoints at all, only the journal's last `spare` positions rewind); `cache`:
        the prefix cache or None."""
        self.state, self.spec = state, spec
        self.stride = stride
        self.cache = cache
        self.notice = notice or (lambda m: None)
        draft_state = spec.state if spec is not None else None
        self.buffers = ckpt.ring_buffers(state, draft_state)
        self.fills = ckpt.ring_fills(state, draft_state)
        self.rows = {name: r.data for name, r in state.rows.items()}
        self.history: list[int] = []  # the ids at positions 0 .. state.length - 1
        self.ckpts: dict[int, ckpt.RingSnapshot] = {}  # live checkpoints not in the cache (yet)
        self.branch: int | None = None  # a position the running prefill checkpoints (the match point)
        self.last: dict = {}  # what the last restore did (Done.prefix_cache)
        self.executed: Restore | None = None  # the last restore carried out (the ranks compare it)

    # --- the live state -------------------------------------------------------------------------------

    def reset(self) -> None:
        self.state.reset()
        if self.spec is not None:
            self.spec.reset()
        self.history, self.ckpts, self.branch = [], {}, None

    def sync(self) -> None:
        """Re-read the ids from the device if something advanced the state behind the timeline's back
        (a benchmark's raw forward)."""
        n = self.state.length
        if len(self.history) != n:
            self.history = self.state.tokens[:n].tolist()
            self.ckpts = {c: k for c, k in self.ckpts.items() if c <= n}

    def extend(self, ids: list[int]) -> None:
        """Ids the session just processed (a prefill chunk, a decode cycle)."""
        self.history += ids

    def checkpoint(self, position: int | None = None, made: dict | None = None) -> None:
        """Keep the rings at the state's length, or at `position` inside the chunk just prefilled with the
        target's rings `made` there (state.RingTaps) and the rest as they are now (the drafter's, observed up
        to `position`)."""
        n = self.state.length if position is None else position
        if self.stride and n > 0 and n not in self.ckpts:
            self.ckpts[n] = ckpt.take(n, self.buffers, made)

    def cut_points(self, start: int, end: int) -> list[int]:
        """Positions in (start, end] where a prefill over ids[start:end] checkpoints."""
        cuts = {end}
        if self.stride:
            cuts.update(range((start // self.stride + 1) * self.stride, end, self.stride))
        if self.branch is not None and start < self.branch < end:
            cuts.add(self.branch)
        return sorted(c for c in cuts if c > start)

    def crossed_stride(self, before: int) -> bool:
        n = self.state.length
        return bool(self.stride) and n // self.stride > before // self.stride

    # --- restore --------------------------------------------------------------------------------------

    def plan(self, ids: list[int]) -> Restore:
        """How to bring the live state to the longest prefix of `ids` any tier holds (at most len(ids) - 1:
        the last prompt id is always processed). Reads the tiers and changes nothing: on several ranks this
        is rank 0's decision (plan.py), which every rank then executes."""
        self.sync()
        live = common_prefix(self.history, ids, len(ids) - 1)
        match = self._match(ids)
        target = max(live, match.length)
        if target <= live and target == self.state.length:
            return Restore("keep", target, target, live)
        if target <= live and self.state.can_undo(target):
            return Restore("undo", target, target, live)
        return self._choose(target, live, match)

    def execute(self, ids: list[int], plan: Restore) -> int:
        """Carry out `plan` with this rank's tiers; returns the positions kept (cached_tokens). Raises
        Unavailable, having changed nothing, when a tier lacks what the plan restores from (a checkpoint
        or rows it no longer holds, a cache file that cannot be read: the file is then dropped)."""
        t0 = time.perf_counter()
        self.sync()
        self.branch = None
        match = self._match(ids)
        if self.cache is not None and len(ids) > 1:
            self.cache.clock += 1
            self.cache.touch(match.path)
        landed, live = plan.landed, plan.live
        source, moved = "device", 0
        if plan.how == "keep":
            if self.state.length != landed:
                raise Unavailable(f"the live state holds {self.state.length} positions, not {landed}")
        elif plan.how == "undo":
            if not self.state.can_undo(landed):
                raise Unavailable(f"the journal cannot rewind {self.state.length} positions to {landed}")
            self.state.rewind(landed)
            if self.spec is not None:
                self.spec.sync(landed)
        elif plan.how == "checkpoint":
            if plan.checkpoint not in self.ckpts:
                raise Unavailable(f"no live checkpoint at {plan.checkpoint}")
            moved += self._restore(self.ckpts[plan.checkpoint], landed)
        elif plan.how == "cache":
            source, moved = self._from_cache(ids, plan, match)
        else:
            self._restore(None, 0)
        if landed < plan.target:
            self.branch = plan.target
        self.history = self.history[:landed] if landed <= live else list(ids[:landed])
        self.ckpts = {c: k for c, k in self.ckpts.items() if c <= min(landed, live)}
        if self.state.device.type == "cuda" and moved:
            torch.cuda.current_stream().synchronize()  # the restore time includes the copies
        self.last = {"source": source if landed else "none", "matched_tokens": plan.target, "cached_tokens": landed,
                     "restored_bytes": moved, "restore_ms": (time.perf_counter() - t0) * 1e3}
        self.executed = plan
        return landed

    def prepare(self, ids: list[int]) -> int:
        """Plan and execute in this process alone (one rank, benchmarks, tests); from the empty state when a
        tier fails to deliver (a damaged file: reported and dropped)."""
        try:
            return self.execute(ids, self.plan(ids))
        except Unavailable:
            return self.execute(ids, COLD)

    def _match(self, ids: list[int]) -> Match:
        """The prefix cache's longest match of ids[:-1] (the last prompt id always runs)."""
        if self.cache is None or len(ids) <= 1:
            return Match()
        return self.cache.match(torch.tensor(ids[:-1], dtype=torch.long))

    def _from_cache(self, ids: list[int], plan: Restore, match: Match) -> tuple[str, int]:
        """Restore from the prefix cache: the rows of positions [live, landed) and the rings of the checkpoint
        at `plan.checkpoint`. Returns (where the rows came from, bytes copied)."""
        landed, live = plan.landed, plan.live
        found = self.cache.checkpoint_at(match, plan.checkpoint) if self.cache is not None else None
        if found is None or match.length < landed:
            raise Unavailable(f"the prefix cache holds no checkpoint at {plan.checkpoint} on the prompt's path "
                              f"(it matches {match.length} positions)")
        need = [p for p in match.path if p.end > live and p.start < landed]
        source = "host" if landed > live else "device"  # where the rows come from
        if any(not p.on_host for p in need) or found.ref.host is None:
            source = "disk"
            try:
                self.cache.load(need, [found.ref])
            except CacheFileError as e:
                self.notice(str(e))
                self.cache.disk.rejected.append(str(e))
                self.cache.forget_file(e.fid)
                raise Unavailable(str(e)) from None
        self.cache.touch([found.node])
        moved = 0
        if landed > live:
            moved += self.cache.rows_into(need, live, landed, self.rows)
            self.state.tokens[live:landed].copy_(torch.tensor(ids[live:landed], dtype=torch.long))
            moved += (landed - live) * 8
        return source, moved + self._restore(found.ref.host, landed)

    def _choose(self, target: int, live: int, match: Match) -> Restore:
        """The restore that lands nearest `target`, from a checkpoint: one in [target, target + spare] lands
        on the target itself, else the last one before it does. A checkpoint serves where its branch agrees
        with the prompt: the live ones below `live`, the cache's below `match.length`. The live state wins
        ties (nothing to copy); without any checkpoint, the empty state."""
        spare = self.state.spare
        best = Restore("empty", 0, target, live)
        for c in self.ckpts:
            if target <= live and target <= c <= target + spare:
                at = target
            elif c <= min(target, live):
                at = c
            else:
                continue
            if at > best.landed:
                best = Restore("checkpoint", at, target, live, c)
        if self.cache is not None and match.length:
            found = self.cache.checkpoint_for(match, target, spare)
            if found is not None and min(found.position, target) > best.landed:
                best = Restore("cache", min(found.position, target), target, live, found.position)
        return best

    def _restore(self, rings: ckpt.RingSnapshot | None, landed: int) -> int:
        """Put the rings of a checkpoint in place and cut the target state to `landed` (its drafter to
        landed - 1); returns the bytes copied."""
        if landed == 0:
            self.state.reset()
            if self.spec is not None:
                self.spec.reset()
            return 0
        moved = ckpt.restore(rings, self.buffers, self.fills)
        self.state.truncate(landed)
        if self.spec is not None:
            self.spec.truncate(landed - 1)
        return moved

    def rewind(self, position: int) -> int:
        """Go back to `position` (<= the state's length) through any tier; returns where it landed (the
        caller prefills history[landed:position] to get there, as `prepare` leaves it)."""
        return self.prepare(self.history[:position] + [0])

    # --- commit ---------------------------------------------------------------------------------------

    def commit(self, file: bool = True) -> None:
        """End of a request: checkpoint the state and (`file`) file the whole conversation in the cache."""
        self.sync()
        self.checkpoint()
        cache = self.cache
        if cache is None or not file or not self.history:
            return
        state = self.state

        def rows_of(a: int, b: int) -> dict[str, torch.Tensor]:
            return {name: ckpt.to_host(state.rows[name].data[a // m: b // m]) for name, m in cache.ratios.items()}

        ids = torch.tensor(self.history, dtype=torch.long)
        new, path, added = cache.insert(ids, rows_of, self.ckpts)
        if state.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the host copies are read below (disk) and kept
        if cache.disk is not None and (new is not None or added):
            self._write(new, path, added, ids)
        self.ckpts = {}
        cache.evict(newest=path[-1] if path else None)

    def _write(self, new, path, added, ids) -> None:
        """File the conversation's new part on disk (best effort: prefix_disk.py; whatever fails, it stays in
        host memory and the request's outcome is untouched)."""
        cache, disk = self.cache, self.cache.disk
        if not disk.available():  # off for a while after failures in a row
            return
        start = new.start if new is not None else len(self.history)
        parent = ""
        if start > 0:
            holder = next((p for p in path if p.start <= start - 1 < p.end), None)
            if holder is None or holder.disk is None:
                self.notice(f"prefix cache: positions before {start} are not on disk; this request stays in "
                            "host memory only")
                return
            parent = holder.disk[0]
        rows = new.rows if new is not None else {name: self.rows[name][:0].cpu() for name in cache.ratios}
        tensors = disk.tensors(ids[start:], rows, {c: r.host for c, r in added.items()})
        keep = {p.disk[0] for p in path if p.disk is not None}
        for gone in disk.evict(keep, room=sum(t.numel() * t.element_size() for t in tensors.values())):
            cache.forget_file(gone)  # room first: the budget holds with the new file in it
        try:
            fid = disk.write(parent, start, tensors, sorted(added))
        except Exception as e:  # noqa: BLE001 - a read-only or full directory: safetensors' errors too
            disk.failed("write", e)
            return
        disk.succeeded()
        if new is not None:
            new.disk = (fid, start)
        for r in added.values():
            r.file = fid
