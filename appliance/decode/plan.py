"""One request as every rank runs it: rank 0 decides, every rank executes.

On several ranks each process holds its shard of the model and its own copy of the decode state, the
checkpoints and the prefix cache. Anything that shapes a collective or the state must be decided once:
a rank that restored its prefix from another position, cut its chunks elsewhere or drafted another
number of tokens would enter a collective of another shape, and the transport would abort. So rank 0's
request loop decides (decode/loop.py makes a `Job`: the prompt's ids, the sampling seed, the chunk, the
restore `Restore` its timeline planned; its session adds what happens at the end) and its session
publishes it; every rank, rank 0 included, runs the job (`DecodeSession.run`); inside it the only
decisions left (go on or stop before each chunk and cycle; an adaptive draft's length) are rank 0's too,
shared through the `Steer`. A follower's caches are only ever read to carry out a plan, never to make
one; a rank that lacks what a plan needs (a cache file it could not write) says so, and every rank then
starts from the empty state.

After the restore the ranks compare what they did (`agreement`): the plan, the state's length and ids.
A difference is named (`RankDivergence`, both ranks' plans) instead of being left to the transport.
"""

import zlib
from dataclasses import dataclass

import torch

from appliance.errors import RankDivergence

# how a restore reaches its landing position, in the order the timeline tries the tiers
HOWS = ("empty", "keep", "undo", "checkpoint", "cache")


@dataclass(frozen=True)
class Restore:
    """How the live state reaches the longest prefix of a prompt that any tier holds.

    `how`: empty (back to position 0), keep (the live state is already there), undo (the journal rewinds
    the last positions), checkpoint (a live checkpoint's rings), cache (the prefix cache's rows and a
    checkpoint's rings, from host memory or disk). `landed`: positions kept (cached_tokens); `target`: the
    longest prefix any tier shares (a prefill from `landed` checkpoints there: the next branch is free);
    `live`: the prefix the live state shares with the prompt; `checkpoint`: the position of the checkpoint
    whose rings are restored (checkpoint, cache), else None."""

    how: str
    landed: int
    target: int
    live: int
    checkpoint: int | None = None

    def __post_init__(self):
        if self.how not in HOWS:
            raise ValueError(f"Restore.how={self.how!r}: must be one of {', '.join(HOWS)}")


COLD = Restore("empty", 0, 0, 0)  # what every rank can execute: the fallback when one cannot execute a plan


@dataclass(frozen=True)
class Job:
    """A request as the device runs it (no text: ids in, ids out). `chunk`: the prefill chunk; `commit`: file
    the conversation in the prefix cache at the end (off for the warm-up); `reset`: empty the live state at
    the end (the warm-up leaves nothing behind). The session sets both for a warm-up (`DecodeSession.warming`)."""

    id: str
    ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    restore: Restore
    chunk: int
    commit: bool = True
    reset: bool = False


class Unavailable(Exception):
    """This rank lacks what a restore plan restores from (a checkpoint, rows, a readable cache file)."""


class Aborted(Exception):
    """Rank 0 ended the job without finishing it (its request loop failed): every rank resets."""


GO, STOP, ABORT = 1, 0, -1


class Steer:
    """Rank 0's decisions inside a job, the same on every rank. Before each prefill chunk and each decode
    cycle the job asks `proceed()`: rank 0's request loop has said whether the request goes on (`stop()`
    after the last token, a stop string, a cancel, through `DecodeSession.stop`; `abort_followers()` when
    the loop failed), and on several ranks that word is broadcast, so every rank goes on or stops at the
    same step. `shared(value)` gives rank 0's value of something the host picks (an adaptive draft length)
    on every rank."""

    def __init__(self, world=None):
        self.world = world if world is not None and world.distributed else None
        self.word = GO

    @property
    def main(self) -> bool:
        return self.world is None or self.world.main

    def stop(self) -> None:
        self.word = STOP

    def abort_followers(self) -> None:
        """Rank 0 leaves a job half way (its loop failed): the followers, waiting in their next proceed(),
        abort it too."""
        self.word = ABORT
        self.shared(ABORT)

    def shared(self, value):
        return value if self.world is None else self.world.broadcast(value if self.world.main else None)

    def proceed(self) -> bool:
        word = self.shared(self.word)
        if word == ABORT:
            raise Aborted("rank 0 ended the job")
        return word == GO


def crc(data) -> int:
    """A 31-bit checksum of bytes, or of the ints of a tensor on any device (the ids a state holds): cheap
    to compare across ranks."""
    if isinstance(data, torch.Tensor):
        data = data.to(torch.long).cpu().contiguous().numpy().tobytes()
    return zlib.crc32(data) & 0x7FFFFFFF


def gather(world, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (as many on every rank), on every rank: a collective; [values] on one rank."""
    return world.gather(values) if world is not None and world.distributed else [values]


def gather_objects(world, obj) -> list:
    """Every rank's picklable `obj`, on every rank (rare paths: naming what differs)."""
    return world.gather_objects(obj) if world is not None and world.distributed else [obj]


def agreement(world, values, describe) -> None:
    """Every rank's `values()` (as many ints on every rank) compared with rank 0's; on a difference every
    rank raises RankDivergence naming rank 0's `describe()` and the first differing rank's. A collective:
    every rank calls it at the same point of the same job. Nothing to compare (or compute) on one rank."""
    if world is None or not world.distributed:
        return
    rows = world.gather(values())
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        said = world.gather_objects(describe())
        r = differ[0]
        raise RankDivergence(f"ranks diverged: rank 0 {said[0]}; rank {r} {said[r]}", field="plan", value=r)


__all__ = ["COLD", "Aborted", "Job", "Restore", "Steer", "Unavailable", "agreement", "crc", "gather", "gather_objects"]
