"""Decode state: every buffer preallocated at load for the maximum context, at fixed addresses.

All state is indexed by absolute position, so it is rewindable without snapshots:
- a `PositionRing` keeps the last `size` positions (slot = position mod size). Its size is what a reader
  needs (the 128-token window, or a compressor's pooling span) plus `spare` positions, so that rewinding
  up to `spare` positions leaves every slot a reader can still reach untouched;
- a `RowCache` holds compressed rows (row j covers positions [j*m, (j+1)*m)); rows past the current
  length are never visible (visibility is derived from the position) and are overwritten when regenerated;
- `tokens` is the committed token history (Engram's n-grams, prefix reuse).
Every eager write also goes to a `Journal` that keeps the overwritten values of the last `spare` positions,
so `rewind(p)` after eager calls restores the buffers exactly. Decode cycles write without it: a rejected
draft's writes are left where no reader reaches (see `Journal`), so the live state after a cycle is what
plain decoding of the accepted tokens leaves.

Further back, a state is rewound from a copy of its rings (appliance/decode/checkpoint.py): the rings are
the only buffers that forget, so copying them in, keeping the rows and ids below the new length and
`truncate`-ing the rest returns the state to that position. What a reader can reach then equals a fresh
prefill (`live_buffers`); only the spare slots of a ring, which no reader reaches, may differ.
"""

from contextlib import contextmanager
from functools import partial

import torch

from appliance.errors import StateError
from kernels import ring_rows

# positions a call at a device-scalar start takes from a state's `offsets` with one add: a verify's rows, a
# draft block's, a draft window's keys (128 in V4.1)
FOLLOWING = 512


class Journal:
    """Overwritten values, per written position, for the last `keep` positions, for host-driven rewinds of
    eager calls: every write is kept (with its newest position read back to the host) until it is `keep`
    positions old, and `undo(p)` restores from the host.

    Decode cycles (captured as CUDA graphs) write with the journal off: what they overwrite is never read
    again, rejected drafts included. A ring slot a write of position p takes held p - size, out of every
    reader's reach once the length is within `spare` of p; compressed rows and ids past the length are
    invisible until rewritten. So after a cycle, and after a rewind of at most `spare` positions, the live
    state (`DecodeState.live_buffers`) is the one plain decoding leaves; only the unreachable slots may
    differ."""

    def __init__(self, keep: int):
        self.keep = keep
        # (buffer, written indices, overwritten values, their positions, the newest position as an int)
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self.paused = False
        self.floor: int | None = None  # while committing: writes for positions below it are not kept

    @property
    def recording(self) -> bool:
        return not self.paused

    @contextmanager
    def off(self):
        """Writes inside are not journaled: a decode cycle (its writes cost no copy of what they overwrite;
        the positions it wrote cannot be restored exactly from the journal, only out of reach)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def record(self, data: torch.Tensor, index: torch.Tensor, positions: torch.Tensor) -> None:
        if self.paused:
            return
        if self.floor is not None:  # a committed call's writes: only positions >= floor can ever be undone,
            # and a write's positions ascend to at most the call's last: among its last `keep` (no host read)
            index, positions = index[-self.keep:], positions[-self.keep:]
            newest = self.floor + self.keep - 1  # at least the call's last position
        else:
            newest = int(positions.max())
        self.entries.append((data, index.clone(), data[index], positions.clone(), newest))

    def undo(self, position: int) -> None:
        """Restore every value overwritten by a write for a position >= `position`, newest first."""
        kept = []
        for data, index, old, pos, newest in reversed(self.entries):
            if newest < position:
                kept.append((data, index, old, pos, newest))
                continue
            undo = pos >= position
            data[index[undo]] = old[undo]
            if not bool(undo.all()):
                keep = ~undo
                kept.append((data, index[keep], old[keep], pos[keep], int(pos[keep].max())))
        self.entries = kept[::-1]

    def prune(self, length: int) -> None:
        oldest = length - self.keep
        if self.entries and self.entries[0][4] < oldest:
            self.entries = [e for e in self.entries if e[4] >= oldest]


class PositionRing:
    """[size, width] rows; slot = position % size. Holds the last `size` positions written."""

    def __init__(self, size: int, width: int, dtype: torch.dtype, device, journal: Journal, fill: float = 0.0,
                 reach: int | None = None):
        self.size = size
        self.reach = size if reach is None else reach  # the last positions a reader reads (size - spare)
        self.journal = journal
        self.fill = fill
        self.data = torch.full((size, width), fill, dtype=dtype, device=device)
        self.back = torch.arange(1 - self.reach, 1, device=device)  # `window_slots`' offsets, made before a capture
        self.tap = None  # set while a state is `tapping`: sees each write before it lands (RingTaps)

    def slot_positions(self, start: int) -> torch.Tensor:
        """Position held by each slot when positions [0, start) were written in order (-1 = never)."""
        s = torch.arange(self.size, device=self.data.device)
        q = (start - 1) - torch.remainder(start - 1 - s, self.size)
        return torch.where(q >= 0, q, torch.full_like(q, -1))

    def window_slots(self, last) -> torch.Tensor:
        """The slots of positions last - reach + 1 .. last [reach], oldest first, negative (none) for those
        before 0 (`last` a device scalar: no host read). Two launches: the truncated remainder keeps a position
        before 0 negative (|p| < reach <= size), and readers take a negative row as none."""
        return torch.fmod(last + self.back, self.size)

    def reachable(self, length: int) -> torch.Tensor:
        """The rows a reader at `length` can reach, oldest first: positions max(0, length - reach) .. length-1."""
        positions = torch.arange(max(0, length - self.reach), length, device=self.data.device)
        return self.data[positions % self.size]

    def write(self, positions: torch.Tensor, values: torch.Tensor, slots: torch.Tensor | None = None,
              put=None) -> None:
        """Write rows for consecutive positions (only the last `size` can survive); `slots`: their slots where
        the caller made them (a cycle's host: no launch for the remainder), at most `size` of them; `put`:
        the op that writes them (ops.put_rows: the fast path's one launch), the reference's by default."""
        if self.tap is not None:
            self.tap(self, positions, values)
        if positions.numel() > self.size:
            positions, values = positions[-self.size:], values[-self.size:]
        if slots is None:
            slots = positions % self.size
        self.journal.record(self.data, slots, positions)
        (put or ring_rows.put)(self.data, slots, values)

    def record(self, positions: torch.Tensor) -> None:
        """Journal the slots of `positions` before an op writes them itself (a fused kernel)."""
        if self.journal.recording:
            if positions.numel() > self.size:
                positions = positions[-self.size:]
            self.journal.record(self.data, positions % self.size, positions)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class RingTaps:
    """Each ring as it was at positions inside one long call (a prefill chunk's checkpoints, `points`), made
    from what the call writes: the ring before the call with the call's rows below the point written in.
    `copy` moves a made ring where it is kept (host memory); `rings[point][name]` holds it. A ring the call
    does not write has no entry: it is as it was before the call."""

    def __init__(self, points: list[int], copy):
        self.points, self.copy = points, copy
        self.rings: dict[int, dict[str, torch.Tensor]] = {c: {} for c in points}

    def take(self, name: str, ring: "PositionRing", positions: torch.Tensor, values: torch.Tensor) -> None:
        first = int(positions[0])  # an eager call's positions, consecutive
        for c in self.points:
            if first < c < first + positions.numel():
                lo = max(first, c - ring.size)
                data = ring.data.clone()
                data[torch.arange(lo, c, device=data.device) % ring.size] = values[lo - first:c - first].to(data.dtype)
                self.rings[c][name] = self.copy(data)


class RowCache:
    """Compressed rows for one layer: [capacity // ratio + 1, width]; the last row absorbs writes of
    positions that complete no group (so writes never branch on the position)."""

    def __init__(self, capacity: int, ratio: int, width: int, dtype: torch.dtype, device, journal: Journal):
        self.ratio = ratio
        self.journal = journal
        self.rows = capacity // ratio
        self.data = torch.zeros((self.rows + 1, width), dtype=dtype, device=device)

    @property
    def trash(self) -> int:
        return self.rows

    def write(self, row_index: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Write rows `row_index` (the trash row for positions that complete no group)."""
        self.journal.record(self.data, row_index, positions)
        self.data[row_index] = values.to(self.data.dtype)

    def record(self, row_index: torch.Tensor, positions: torch.Tensor) -> None:
        """Journal rows `row_index` before an op writes them itself (a fused kernel)."""
        self.journal.record(self.data, row_index, positions)

    def visible(self, bound: int) -> torch.Tensor:
        """Rows a query at position <= `bound` may see: [0, (bound + 1) // ratio)."""
        return self.data[: (bound + 1) // self.ratio]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class DecodeState:
    """One request's decode state for one model. `length` = positions committed so far."""

    def __init__(self, capacity: int, spare: int, device, streams: int = 0):
        self.capacity = capacity
        self.spare = spare
        self.device = device
        self.length = 0
        self.high = 0  # the longest length since the last reset: rows and ids past it are still as allocated
        self.journal_floor = 0  # the journal holds every write since this position (a restore, a prefill)
        self.journal = Journal(spare)
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        # constants a captured call reads, made here (before any graph is captured): `following`'s offsets;
        # the one-hot first collapse of `streams` identical mHC streams (`first_collapse`)
        self.offsets = torch.arange(FOLLOWING, device=device)
        self.first_rows = torch.zeros(FOLLOWING, streams, device=device)
        self.first_rows[:, :1] = 1.0
        self.rings: dict[str, PositionRing] = {}
        self.rows: dict[str, RowCache] = {}

    def position(self) -> int:
        return self.length

    def rewind(self, position: int) -> None:
        """Return to the state after `position` tokens. Possible for the last `spare` positions."""
        if not 0 <= position <= self.length:
            raise StateError(f"rewind({position}): state holds {self.length} positions", field="position",
                             value=position)
        if position == 0:
            self.reset()
            return
        if position < self.length - self.spare:
            raise StateError(f"rewind({position}): only the last {self.spare} of {self.length} positions can be "
                             "rewound (rings keep no older rows); prefill again instead", field="position",
                             value=position)
        if position < self.journal_floor:
            raise StateError(f"rewind({position}): the journal holds no write before {self.journal_floor} (the "
                             "state was restored or prefilled there); rewind from a checkpoint instead",
                             field="position", value=position)
        self.journal.undo(position)
        self.length = position

    def following(self, start, n: int) -> torch.Tensor:
        """Positions start .. start + n - 1 [n]. `start` a host int or a device scalar: one add, where n fits
        `offsets` (no arange launch); or the positions themselves, a device vector from start that the caller
        made (a cycle's, written by the host: appliance/decode/cycle.py): its first n, a view, no launch."""
        if given_positions(start):
            if start.numel() < n:
                raise ValueError(f"following(start, {n}): the given positions hold only {start.numel()}")
            return start[:n]
        if n <= FOLLOWING:
            return start + self.offsets[:n]
        return start + torch.arange(n, device=self.tokens.device)

    def first_collapse(self, n: int, streams: int) -> torch.Tensor:
        """[n, streams] float32: weight 1 on the first of `streams` identical streams, 0 on the rest (read
        only): the state's constant where it has them."""
        if n <= FOLLOWING and self.first_rows.shape[1] == streams:
            return self.first_rows[:n]
        first = torch.zeros(n, streams, device=self.tokens.device)
        first[:, 0] = 1.0
        return first

    def journal_tokens(self, positions: torch.Tensor) -> None:
        """Keep the token history at `positions` for a rewind (journaled like every other write) before the
        forward's token inputs write it (ops.token_inputs)."""
        self.journal.record(self.tokens, positions, positions)

    def can_undo(self, position: int) -> bool:
        """Whether `rewind(position)` can restore the buffers from the journal."""
        return 0 < position <= self.length and position >= max(self.length - self.spare, self.journal_floor)

    def advance(self, n: int) -> None:
        """Count `n` more committed positions (eager calls; a captured cycle's host updates the length)."""
        self.length += n
        self.high = max(self.high, self.length)
        self.journal.prune(self.length)

    def truncate(self, length: int) -> None:
        """Set the length to `length` after the caller has put the rings of that position in place (a
        checkpoint's): ids and compressed rows below it are kept, the rest back to zero as allocated (rows
        past the length are invisible anyway: this keeps a restored state comparable to a fresh one), and
        the journal starts again. Writes in place: buffer addresses never change (captured graphs)."""
        if not 0 <= length <= self.capacity:
            raise StateError(f"truncate({length}): outside the capacity {self.capacity}", field="position",
                             value=length)
        high = max(self.high, self.length)
        if high > length:
            self.tokens[length:high].zero_()
            for r in self.rows.values():
                r.data[length // r.ratio: high // r.ratio].zero_()
        self.journal.entries.clear()
        self.journal_floor = length
        self.length = self.high = length

    def skip_to(self, position: int) -> None:
        """Advance to `position` without writing: for positions whose rows no reader can reach any more
        (a drafter only reads its last window). Their token history stays 0."""
        if position < self.length:
            raise StateError(f"skip_to({position}) is behind the state ({self.length})", field="position")
        self.length = position
        self.high = max(self.high, self.length)
        self.journal.prune(self.length)

    def reset(self) -> None:
        """Back to an empty state (a cold start): every buffer as allocated."""
        for r in self.rings.values():
            r.data.fill_(r.fill)
        for r in self.rows.values():
            r.data.zero_()
        self.tokens.zero_()
        self.journal.entries.clear()
        self.length = self.high = self.journal_floor = 0

    @contextmanager
    def committing(self, end: int):
        """Writes inside are for positions the caller commits up to `end` (a prefill chunk): the journal keeps
        the last `spare` of them, not a copy of everything the chunk overwrites, and cannot rewind below."""
        self.journal.floor = max(end - self.spare, 0)
        try:
            yield
        finally:
            self.journal.floor = None
        self.journal_floor = max(self.journal_floor, end - self.spare)

    @contextmanager
    def tapping(self, points: list[int], copy):
        """Inside: every ring write also makes the ring as it was at each of `points` that falls inside the
        write (RingTaps, yielded); a long call's checkpoints without cutting the call there."""
        taps = RingTaps(points, copy)
        if points:
            for name, ring in self.rings.items():
                ring.tap = partial(taps.take, name)
        try:
            yield taps
        finally:
            for ring in self.rings.values():
                ring.tap = None

    def check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise StateError(f"{self.length} + {n} positions exceed the state capacity {self.capacity}",
                             field="context", value=self.length + n)

    def ring(self, name: str, size: int, width: int, dtype, fill: float = 0.0) -> PositionRing:
        """A ring of `size` slots, the last `spare` of them slack a reader never reaches."""
        self.rings[name] = PositionRing(size, width, dtype, self.device, self.journal, fill, reach=size - self.spare)
        return self.rings[name]

    def row_cache(self, name: str, ratio: int, width: int, dtype) -> RowCache:
        self.rows[name] = RowCache(self.capacity, ratio, width, dtype, self.device, self.journal)
        return self.rows[name]

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every state tensor by name (for tests that compare states tensor by tensor); the trash row of
        each row cache is scratch, not state."""
        out = {"tokens": self.tokens}
        out.update({f"ring.{k}": r.data for k, r in self.rings.items()})
        out.update({f"rows.{k}": r.data[:-1] for k, r in self.rows.items()})
        return out

    def live_buffers(self) -> dict[str, torch.Tensor]:
        """What a reader at the current length can reach, by name: ids and compressed rows below the length,
        and each ring's reachable rows in position order. Two states with equal live buffers compute the
        same next logits (the rings' spare slots and everything past the length are never read)."""
        n = self.length
        out = {"tokens": self.tokens[:n]}
        out.update({f"ring.{k}": r.reachable(n) for k, r in self.rings.items()})
        out.update({f"rows.{k}": r.data[: n // r.ratio] for k, r in self.rows.items()})
        return out

    @property
    def nbytes(self) -> int:
        return (self.tokens.numel() * 8 + sum(r.nbytes for r in self.rings.values())
                + sum(r.nbytes for r in self.rows.values()))


def given_positions(start) -> bool:
    """Whether a static call's `start` is its positions themselves (a device vector from start, made by the
    caller) rather than a host int or a device scalar."""
    return isinstance(start, torch.Tensor) and start.dim() == 1


def shifted(start, i: int):
    """Position start + i, `start` as `DecodeState.following` takes it: a host int or a device scalar plus i
    (a scalar's: one add), or a positions vector's view from its i-th (no launch)."""
    return start[i:] if given_positions(start) else start + i


def new_state(capacity: int, spare: int, device, attentions, streams: int = 0) -> DecodeState:
    """A model's decode state: each attention of `attentions` adds its buffers (`init_state`); `streams`,
    its mHC streams (`first_collapse`). `device` "meta" sizes the state without allocating it."""
    state = DecodeState(capacity, spare, device, streams)
    for attn in attentions:
        attn.init_state(state, spare)
    return state
