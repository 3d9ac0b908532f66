"""Speculative decoding: a drafter proposes k tokens, the target verifies them in one forward, and the
accepted prefix plus one target token are committed (the cycle itself: appliance/decode/cycle.py). Lossless:
greedy output equals plain greedy decoding token for token (the target's forward is batch invariant: a
verified row equals a single-step row bitwise), and sampled output has the target's distribution.

The `Speculator` owns the drafter's state, kept one position behind the target's: after the target has
committed positions 0..N-1, the drafter holds rows for 0..N-2, and the target row of N-1 waits in a small
ring of the target's state (so rewinds restore it) until the next draft writes it. A DSpark's commit needs
no next token, so its verify commits every row it made and the next draft's row of N-1 is among them
(`Speculator.ahead`; after a prefill, rewind or restore `catch_up` writes it before the cycle).
"""

import math
from dataclasses import dataclass, field

import torch

from appliance.errors import RequestError
from appliance.model.mtp import MAX_DRAFTS as MTP_MAX_DRAFTS


@dataclass
class DraftStats:
    draft: str
    k: int
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # cycles by number of accepted drafts (0..k)

    def record(self, drafted: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.histogram) <= accepted:
            self.histogram += [0] * (accepted + 1 - len(self.histogram))
        self.histogram[accepted] += 1

    def as_dict(self) -> dict:
        return {"draft": self.draft, "draft_tokens": self.k, "cycles": self.cycles, "drafted": self.drafted,
                "accepted": self.accepted,
                "mean_accepted": self.accepted / self.cycles if self.cycles else 0.0,
                "tokens_per_cycle": (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0,
                "acceptance_histogram": self.histogram}


class Speculator:
    """The drafter, its state kept one position behind the target's, and what a cycle needs of them."""

    def __init__(self, drafter, mode: str, k: int, target_state):
        self.drafter = drafter
        self.mode = mode  # "dspark" | "mtp" | "adaptive"
        self.k = k
        self.target_state = target_state  # read for the next tokens of committed positions (observe)
        self.state = drafter.new_state(target_state.capacity, target_state.spare)
        # the drafter's input rows (DSpark: H; MTP: the final streams) of the target's last positions,
        # kept in the target's state so that rewinds restore them too
        self.row_shape = tuple(drafter.row_shape)
        self.rows = target_state.ring("draft_rows", target_state.spare + 2, math.prod(self.row_shape),
                                      drafter.rt.dtype)
        self.block = drafter.cfg.dspark.block_size if drafter.kind == "dspark" else k
        self.step_cost: list[float] | None = None  # verify ms per width 1..k+1 (adaptive)
        self.force_accept: int | None = None  # benchmarks: accept exactly this many drafts per cycle
        # whether the drafter's rings hold the key row of q = N - 1 (N the target's length) past its committed
        # rows: a verify of a drafter that `commits_ahead` leaves them so; a prefill, rewind or restore does
        # not (`catch_up` writes it before the next cycle's draft, which reads it without writing it)
        self.ahead = False

    @property
    def adaptive(self) -> bool:
        """Draft and verify as two steps, the host choosing the verify width from the drafter's confidence."""
        return self.mode == "adaptive" and self.drafter.kind == "dspark"

    def inputs(self) -> dict[str, torch.Tensor]:
        return {f"draft.{name}": t for name, t in self.state.buffers().items()}

    def window_ring(self) -> tuple[int, int]:
        """(size, reach) of a DSpark's stage rings (every stage's alike: `DSpark.draft`'s window); (0, 0) for
        MTP, whose head gathers its window itself."""
        if self.drafter.kind != "dspark":
            return 0, 0
        ring = self.state.rings[self.drafter.stages[0].attn.name]
        return ring.size, ring.reach

    def reset(self) -> None:
        self.state.reset()
        self.ahead = False

    def truncate(self, length: int) -> None:
        """The drafter's state cut to `length` rows under a restored checkpoint's rings (DecodeState.truncate)."""
        self.state.truncate(length)
        self.ahead = False

    def catch_up(self, length: int) -> None:
        """Before a cycle at the target's `length` (N >= 1): where a drafter that `commits_ahead` lacks the key
        row of q = N - 1 (after a prefill, rewind or restore), write it from the kept target row, as the draft
        of a drafter that does not writes it inside the cycle. The write is eager (journaled); the drafter's
        length stays one behind the target's (its start a device scalar: not counted)."""
        if self.ahead or not self.drafter.commits_ahead or length < 1:
            return
        q = torch.tensor([length - 1], device=self.rows.data.device)
        self.drafter.commit(self.state, self.rows_at(q), None, q)
        self.ahead = True

    def cycled(self, count: int) -> None:
        """After a cycle that kept `count` positions: the drafter's length follows the target's, one behind,
        and its rings hold the next q where its verify committed it (`commits_ahead`: VerifyStep)."""
        self.state.advance(count)
        self.ahead = self.drafter.commits_ahead

    def sync(self, length: int) -> None:
        """Bring the drafter's state to `length - 1` committed rows after the target rewound to `length`."""
        self.ahead = False
        want = max(length - 1, 0)
        if want < self.state.length:
            if want >= self.state.length - self.state.spare and want > 0:
                self.state.rewind(want)
            else:
                self.state.reset()

    def observe(self, out, start: int, span: tuple[int, int] | None = None) -> None:
        """After an eager target forward (a prefill chunk) over positions start..start+n-1: keep their rows
        and give the drafter every row whose next token is now known (all but the last). `span`: only the
        positions span[0]..span[1]-1 of the forward (a chunk's piece up to a checkpoint inside it: the
        drafter then holds what a chunk cut there would have left)."""
        self.ahead = False
        rows = self.drafter.rows(out)
        if span is not None:
            rows, start = rows[span[0] - start:span[1] - start], span[0]
        n = rows.shape[0]
        device = rows.device
        self.rows.write(torch.arange(start, start + n, device=device), rows.reshape(n, -1))
        end = start + n - 1
        first = self.state.length
        if first >= end:
            return
        window = self.drafter.cfg.window_size + self.state.spare
        if end - first > window:  # only the last `window` rows can reach a draft: skip the rest
            first = end - window
            self.state.skip_to(first)
        positions = torch.arange(first, end, device=device)
        nxt = self.target_state.tokens[positions + 1]  # the target's history holds the next tokens
        # rows of this chunk from the forward itself: the ring keeps only its last spare + 2, and the drafter's
        # ring slack (a rewind's reach) must hold true rows too
        kept = self.rows_at(positions)
        fresh = positions >= start
        kept[fresh] = rows.reshape(n, *self.row_shape)[positions[fresh] - start].to(kept.dtype)
        self.drafter.commit(self.state, kept, nxt, first)

    def rows_at(self, positions: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The kept target rows of `positions` [n] (a device tensor; `slots`: their ring slots where the caller
        made them) -> [n, *row_shape]."""
        slots = positions % self.rows.size if slots is None else slots
        return self.rows.data[slots].reshape(len(positions), *self.row_shape)

    def calibrate(self, model, repeats: int = 5) -> list[float]:
        """Measure the target `model`'s verify cost per width (1 .. block + 1 rows) on this device, in ms
        (median), on a scratch state: the table `--draft adaptive` trims drafts with."""
        import time

        widths = self.drafter.cfg.dspark.block_size + 1 if self.drafter.kind == "dspark" else self.k + 1
        state = model.new_state(64 + widths * repeats, self.target_state.spare)
        dev = state.device
        sync = torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)
        model.forward(torch.zeros(32, dtype=torch.long, device=dev), state)
        cost = [0.0]
        for w in range(1, widths + 1):
            times = []
            for _ in range(repeats):
                sync()  # device time, not launch time
                t = time.perf_counter()
                model.forward(torch.zeros(w, dtype=torch.long, device=dev), state)
                sync()
                times.append((time.perf_counter() - t) * 1e3)
                state.rewind(32)
            cost.append(sorted(times)[len(times) // 2])
        self.step_cost = cost
        return cost

    def adaptive_length(self, confidence: torch.Tensor | None) -> int:
        """The draft length with the most expected tokens per unit of verify time: draft i survives with
        prob prod_{m<=i} sigmoid(c_{m-1}); a cycle of length l yields 1 + sum of survivals."""
        if confidence is None or not self.step_cost:
            return self.k
        survive = torch.cumprod(torch.sigmoid(confidence.double()), 0).tolist()
        best, best_rate = 1, -1.0
        for n in range(1, min(len(survive), len(self.step_cost) - 1) + 1):
            rate = (1 + sum(survive[:n])) / self.step_cost[n]
            if rate > best_rate:
                best, best_rate = n, rate
        return best


def make_speculator(drafter, draft: str, k: int, index_keys: str, model, target_state) -> Speculator | None:
    """`draft`: none | dspark | mtp | adaptive | auto (the checkpoint's own `drafter`, None when it has
    none). `model` and `target_state`: the target the drafts are for."""
    if draft == "none":
        return None
    d = drafter
    if d is None:
        if draft == "auto":
            return None
        raise RequestError(f"--draft {draft}: this checkpoint has no drafter (mtp.* tensors)", field="draft")
    if draft in ("dspark", "mtp") and d.kind != draft:
        raise RequestError(f"--draft {draft}: this checkpoint's drafter is {d.kind}", field="draft")
    if index_keys == "reference":
        raise RequestError("--index-keys reference reproduces the released single-token decode; it cannot be "
                           "verified in blocks: use --draft none with it", field="draft")
    block = d.cfg.dspark.block_size if d.kind == "dspark" else MTP_MAX_DRAFTS
    if not 1 <= k <= block:
        raise RequestError(f"--draft-tokens {k}: must be 1..{block}", field="draft_tokens")
    mode = "adaptive" if draft == "adaptive" else d.kind
    spec = Speculator(d, mode, k, target_state)
    if mode == "adaptive":
        spec.calibrate(model)
    return spec
