"""The decode cycle as steps over static buffers, so that graphs/ can capture each as a CUDA graph and
replay it with one small device-to-host copy of the result.

Inputs (`CycleBuffers`, device tensors written in place by the host before a run):
    anchor    [1]     the token for position N, not processed yet
    positions [B + 2] N - 1 .. N + B (a static call takes its positions as its start: model/step.py)
    row_slots [B + 2] their slots in the speculator's ring of target rows (with a drafter)
    window    [W]     DSpark: its stages' ring slots of positions N - W .. N - 1 (negative: none)
    params    [3]     temperature, top_p, top_k (kernels.sampling)
    key       [2]     seed and counter of the device RNG (the counter advances inside the cycle)
    force     []      benchmarks: accept exactly this many drafts (-1: off)
The host makes the positions and slots with N (`CycleBuffers.load`: two numpy operations over a small table
and one copy with the anchor and force), so that a cycle launches no index arithmetic.
Output: result [width + 2] = count (tokens produced), accepted drafts, then the tokens.

Without a drafter (`PlainCycle`, width 1): process the anchor, sample the next token. With one:
  1. draft (`DraftStep`): the drafter writes its ring row of N-1 and proposes d_1..d_B for N+1..N+B, writing
     them (with their distributions and confidences) into the buffers;
  2. verify (`VerifyStep`, width k+1): one target forward over [anchor, d_1..d_k] at positions N..N+k;
  3. accept: j drafts and the next token b (kernels.sampling: greedy prefix, or min(1, p/r)), the op
     writing the result (one launch on the fast path);
  4. commit: the drafter's rows of N..N+k-1 are written; the host then counts N+j+1 positions. The writes
     for rejected positions stay where no reader reaches them (appliance/model/state.py, `Journal`):
     nothing is copied or rolled back, as in a plain cycle.
A fixed draft length runs 1-4 as one step (one graph). `--draft adaptive` runs the draft step, reads the
confidences (a second small copy), and replays the verify step of the width it chose.
The host then sets the states' lengths from `count`: nothing else crosses to the host.

A step receives what it uses: the `Target` (model, its state, how it runs), the speculator, the buffers;
sampling and acceptance are the op registry's (`ops.sample`, `ops.accept`), the same code on every path.

Reach: a target step reads the compressed rows of positions below its reach, not the whole capacity, so
a cycle at 2K tokens of a 1M-token state costs what the 2K-token context needs. The reach is static (a
graph's shapes are), so each target step is made once per reach (`reaches`: doubling from `floor` to the
capacity) and the host picks the smallest reach that holds every position the cycle writes.
"""

from dataclasses import dataclass

import numpy as np
import torch

from appliance.model.step import Draft


def reaches(capacity: int, floor: int) -> list[int]:
    """Reaches floor, 2 floor, 4 floor, ... below the capacity, then the capacity itself."""
    out = []
    r = floor
    while r < capacity:
        out.append(r)
        r *= 2
    return out + [capacity]


def reach_for(reach_list: list[int], end: int) -> int:
    """The smallest reach holding positions < `end`."""
    for r in reach_list:
        if end <= r:
            return r
    raise ValueError(f"positions up to {end - 1} exceed the largest reach {reach_list[-1]}")


NO_MODULUS = 1 << 62  # a position's: fmod leaves it as it is


class CycleBuffers:
    def __init__(self, device, block: int, vocab: int, rows_ring: int = 0, window_ring: tuple[int, int] = (0, 0)):
        """`block`: the most drafts a cycle verifies (1 without a drafter); `rows_ring`: the size of the
        speculator's ring of target rows (0: no drafter); `window_ring`: (size, reach) of a DSpark's stage
        rings ((0, 0): none)."""
        # what the host computes from N: each entry fmod(N - 1 + offset, modulus) (fmod keeps a position
        # before 0 negative: none to a window's reader)
        n = block + 2
        size, reach = window_ring
        offsets = [range(n), range(n) if rows_ring else (), range(1 - reach, 1)]
        moduli = [NO_MODULUS, rows_ring, size]
        self._offsets = np.array([o for part in offsets for o in part], dtype=np.int64)
        self._moduli = np.array([m for part, m in zip(offsets, moduli) for _ in part], dtype=np.int64)
        made = len(self._offsets)
        # one int64 buffer so that one copy writes what the host gives: the made entries, force, then the
        # anchor and the drafts the draft step leaves for the verify step (a verify's tokens, one view); the
        # host writes its staging through numpy (a torch operation on the host costs microseconds, this
        # runs between a cycle's result and the next replay)
        self._host = torch.zeros(made + 2, dtype=torch.long, pin_memory=torch.device(device).type == "cuda")
        self._staged = self._host.numpy()
        self._given = torch.zeros(made + 2 + block, dtype=torch.long, device=device)
        ends = [0, *torch.tensor([len(o) for o in offsets]).cumsum(0).tolist()]
        self.positions, self.row_slots, self.window = (self._given[a:b] for a, b in zip(ends, ends[1:]))
        self.force = self._given[made]
        self.tokens = self._given[made + 1:]
        self.anchor, self.drafts = self.tokens[:1], self.tokens[1:]
        self.params = torch.zeros(3, dtype=torch.float32, device=device)
        self.key = torch.zeros(2, dtype=torch.long, device=device)
        self.draft_logits = torch.zeros(block, vocab, dtype=torch.float32, device=device)
        self.confidence = torch.zeros(block, dtype=torch.float32, device=device)

    def load(self, anchor: int, start: int, force: int = -1) -> None:
        """What the host writes before a cycle: the anchor for position N = `start` (>= 1), the positions
        and slots made from N, and `force`. The copy is asynchronous from pinned memory on CUDA: the host
        writes the staging buffer again only after it read the cycle's result (a synchronization)."""
        staged, made = self._staged, len(self._offsets)
        np.fmod(np.add(self._offsets, start - 1, out=staged[:made]), self._moduli, out=staged[:made])
        staged[made], staged[made + 1] = force, anchor
        self._given[:made + 2].copy_(self._host, non_blocking=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device buffers a step reads or writes, by name (graphs/runner.py checks they stay put)."""
        return {name: t for name, t in vars(self).items() if not name.startswith("_")}


@dataclass(frozen=True)
class Target:
    """The target model as the session's prefill and every cycle step run it: its decode state, its op
    registry, and the two options of its forward (V4.1's index-key order; whether the final streams are
    kept, for V4's MTP drafter), bound once."""

    model: object
    state: object  # appliance.model.state.DecodeState
    ops: object  # kernels.registry.Ops
    index_keys: str
    keep_streams: bool

    def forward(self, tokens: torch.Tensor, logits: str = "all", start: torch.Tensor | None = None,
                reach: int | None = None, sampled: str = ""):
        """The one call of the target: without `start` an eager forward at the state's length (prefill, tests;
        exact shapes, the length advances), with it a static one at positions start.. (a device scalar),
        none past reach - 1 (a cycle step; the host counts what it kept); `sampled`: the logits go only to
        samplers (ops.sample, ops.accept), which read a split head's where the ranks hold them
        (parallel/sharding.py VocabParallel)."""
        bound = None if reach is None else reach - 1
        return self.model.forward(tokens, self.state, logits=logits, index_keys=self.index_keys, start=start,
                                  keep_streams=self.keep_streams, bound=bound, sampled=sampled)

    def inputs(self) -> dict[str, torch.Tensor]:
        return self.state.buffers()


class PlainCycle:
    """Width 1: the anchor in, the next token out."""

    width = 1

    def __init__(self, target: Target, buf: CycleBuffers, reach: int):
        self.target, self.buf, self.reach = target, buf, reach
        # count 1 and no accepted drafts, always: the cycle writes only the token
        self.result = torch.tensor([1, 0, 0], dtype=torch.long, device=buf.anchor.device)

    def inputs(self) -> dict[str, torch.Tensor]:
        return {**self.buf.tensors(), **self.target.inputs()}

    def __call__(self) -> dict[str, torch.Tensor]:
        target, buf = self.target, self.buf
        with target.state.journal.off():  # a cycle's writes are not journaled (state.py, `Journal`)
            out = target.forward(buf.anchor, "last", buf.positions[1:], self.reach, sampled="next")
        target.ops.sample(out.logits[-1:], buf.params, buf.key, self.result[2:])
        return {"result": self.result}


class DraftStep:
    """Step 1: the drafter's row of N-1 (where its verify does not leave it: `commits_ahead`), then `k` drafts
    into the buffers."""

    def __init__(self, spec, buf: CycleBuffers, k: int):
        self.spec, self.buf, self.k = spec, buf, k

    def inputs(self) -> dict[str, torch.Tensor]:
        return {**self.buf.tensors(), **self.spec.inputs()}

    def __call__(self) -> dict[str, torch.Tensor]:
        spec, buf, k = self.spec, self.buf, self.k
        # q = N - 1: a DSpark's rings hold its key row already (the last verify's, or Speculator.catch_up's)
        row_q = None if spec.drafter.commits_ahead else spec.rows_at(buf.positions[:1], buf.row_slots[:1])[0]
        into = Draft(buf.drafts[:k], buf.draft_logits[:k], buf.confidence[:k])  # written in place: no copies
        with spec.state.journal.off():  # chained rows (MTP) of N.. are speculative: rewritten before read
            spec.drafter.draft(spec.state, buf.positions, buf.anchor, row_q, k, buf.params, buf.key, into,
                               buf.window)
        return {"confidence": buf.confidence}


class VerifyStep:
    """Steps 2-4 for the first `width - 1` drafts in the buffers."""

    def __init__(self, target: Target, spec, buf: CycleBuffers, width: int, reach: int):
        self.target, self.spec, self.buf, self.width, self.reach = target, spec, buf, width, reach
        self.result = torch.zeros(width + 2, dtype=torch.long, device=buf.anchor.device)

    def inputs(self) -> dict[str, torch.Tensor]:
        return {**self.buf.tensors(), **self.target.inputs(), **self.spec.inputs()}

    def __call__(self) -> dict[str, torch.Tensor]:
        target, spec, buf = self.target, self.spec, self.buf
        state = target.state
        k = self.width - 1
        N = buf.positions[1:]  # N .. N + B
        drafts, draft_logits = buf.drafts[:k], buf.draft_logits[:k]
        tokens = buf.tokens[:k + 1]
        # not journaled (state.py, `Journal`): the writes for rejected positions, the drafter's rows of N+j..
        # included, are rewritten before anything reads them
        with state.journal.off(), spec.state.journal.off():
            out = target.forward(tokens, "all", N, self.reach, sampled="next")
            rows = spec.drafter.rows(out)
            spec.rows.write(out.step.positions, rows.reshape(k + 1, -1), buf.row_slots[1:k + 2],  # N .. N + k
                            target.ops.put_rows)
            target.ops.accept(out.logits, drafts, draft_logits, buf.params, buf.key, buf.force, self.result)
            # N .. N + k - 1, whose next tokens the drafts are; a drafter that needs none takes N + k too: the
            # next draft's q is one of them, whatever the acceptance (its rings keep positions a spare ahead)
            spec.drafter.commit(spec.state, rows[:k + 1] if spec.drafter.commits_ahead else rows[:k], drafts, N)
        return {"result": self.result}


class FixedCycle:
    """Steps 1-4 with a fixed draft length: one callable, one graph."""

    def __init__(self, target: Target, spec, buf: CycleBuffers, k: int, reach: int):
        self.draft, self.verify = DraftStep(spec, buf, k), VerifyStep(target, spec, buf, k + 1, reach)
        self.width = k + 1

    def inputs(self) -> dict[str, torch.Tensor]:
        return self.verify.inputs()

    def __call__(self) -> dict[str, torch.Tensor]:
        self.draft()
        return self.verify()
