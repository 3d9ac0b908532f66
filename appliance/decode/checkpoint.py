"""Checkpoints: copies of the buffers of a decode state that forget, so that it can go back to any position.

Of a state's buffers only the rings forget (appliance/model/state.py): the window keys, the compressors'
and indexers' unfinished groups (their carries) and the drafter's input rows in the target's state, and the
drafter's stage rings in its own. Compressed rows and ids are indexed by position and kept. So the state
at position c is (rows and ids below c) + (every ring as it was at c), and a checkpoint is only the second
part: for V4.1-Flash 7.2 MB with a bf16 state (40 window rings of 144 x 512, 3 DSpark rings, the
compressors' carries, 18 rows of DSpark inputs), against 3.2 KB per token of rows as the reference path
holds them (890 B packed). The default stride of 2048 positions makes a checkpoint about as large as the
rows of the positions it covers, and bounds the prefill of any rewind to 2048 tokens.

A checkpoint taken at c serves every position p in [c - spare, c] without any prefill: each ring holds
`spare` positions more than its readers reach, so at p every reachable slot still holds the row of its own
position (the slots of positions p..c-1 are slack that no reader reads before it is written again). Any
other position p is reached from the nearest checkpoint below it by prefilling ids[c:p] again.

Copies live in host memory (pinned where there is a GPU, and copied without a host sync: the copy is
queued on the stream before anything can overwrite the rings). Restores copy into the state's existing
tensors: buffer addresses never change, so captured CUDA graphs stay valid.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class RingSnapshot:
    """The rings of a target state (and its drafter's, under `draft.`) after `position` ids."""

    position: int
    rings: dict[str, torch.Tensor]
    ready: object = field(default=None, repr=False)  # a CUDA event recorded after the copies (None on CPU)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rings.values())

    def wait(self) -> None:
        """Before the host reads the copies (writing them to disk)."""
        if self.ready is not None:
            self.ready.synchronize()


def ring_buffers(state, draft_state=None) -> dict[str, torch.Tensor]:
    """The live ring tensors a checkpoint copies, by name."""
    out = {name: r.data for name, r in state.rings.items()}
    if draft_state is not None:
        out.update({f"draft.{name}": r.data for name, r in draft_state.rings.items()})
    return out


def ring_fills(state, draft_state=None) -> dict[str, float]:
    out = {name: r.fill for name, r in state.rings.items()}
    if draft_state is not None:
        out.update({f"draft.{name}": r.fill for name, r in draft_state.rings.items()})
    return out


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like `t`, pinned when CUDA is there (asynchronous copies both ways)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned with CUDA; queued without a host sync from a device tensor)."""
    out = host_empty_like(t)
    out.copy_(t, non_blocking=t.device.type == "cuda")
    return out


def take(position: int, buffers: dict[str, torch.Tensor], made: dict[str, torch.Tensor] | None = None) -> RingSnapshot:
    """Copy the rings `buffers` (ring_buffers) of a state at `position`; `made`: host copies already made of
    some of them as they were at `position` (a checkpoint inside a prefill chunk: state.RingTaps)."""
    made = made or {}
    rings = {name: made[name] if name in made else to_host(t) for name, t in buffers.items()}
    ready = None
    if any(t.device.type == "cuda" for t in buffers.values()):
        ready = torch.cuda.Event()
        ready.record()
    return RingSnapshot(position, rings, ready)


def restore(ckpt: RingSnapshot | None, buffers: dict[str, torch.Tensor], fills: dict[str, float]) -> int:
    """Copy a checkpoint's rings into the live tensors `buffers`, in place; None: the rings of an empty state.
    Returns the bytes copied."""
    if ckpt is None:
        for name, t in buffers.items():
            t.fill_(fills[name])
        return 0
    missing = sorted(set(buffers) - set(ckpt.rings))
    if missing:
        raise KeyError(f"checkpoint at {ckpt.position} has no ring {missing[0]}")
    for name, t in buffers.items():
        t.copy_(ckpt.rings[name], non_blocking=True)
    return ckpt.nbytes
