"""One forward call of a model over T consecutive tokens, and what it returns."""

from dataclasses import dataclass, field

import torch

from kernels.sampling import SplitLogits

from .rowsplit import ALL_ROWS, gather_rows, query_share
from .state import DecodeState


@dataclass
class Step:
    """One forward call: T consecutive tokens starting at position `start`."""

    state: DecodeState
    tokens: torch.Tensor  # [T] int64
    start: int | torch.Tensor  # host int (eager) or a device scalar (a capturable cycle; a view of its positions)
    positions: torch.Tensor  # [T] int64
    index_keys: str  # "own" | "reference"
    bound: int  # no position in this call exceeds it: sizes the visible compressed rows (static: the cycle's reach - 1)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [T, k] rows (-1 = none)
    candidates: torch.Tensor | None = None  # [T, B] int64 kept blocks (-1 unused), from the candidate source
    # DSpark's input [rows, targets x D]: the captured layers' streams averaged over the copies, side by side,
    # each written by its layer's site (`capture`)
    hidden: torch.Tensor | None = None
    # split over ranks (`comm`), a long call's residual streams are held by rows: this rank's `share` of the
    # call's rows (rowsplit.query_share); the sub-blocks' inputs are gathered (`gather`)
    comm: object = None
    share: slice = field(default_factory=lambda: ALL_ROWS)

    @property
    def split(self) -> bool:
        return self.share != ALL_ROWS

    def capture(self, X: torch.Tensor, column: tuple[int, int]) -> torch.Tensor:
        """A captured layer's columns of `hidden` ([rows, D] of the streams X [rows, hc, D]; `column`: the
        layer's (i, of n) target layers, `capture_column`; `hidden` made by the first): where its site writes
        the streams' mean."""
        rows, _, dim = X.shape
        i, n = column
        if self.hidden is None:
            self.hidden = torch.empty(rows, n * dim, dtype=X.dtype, device=X.device)
        return self.hidden[:, i * dim:(i + 1) * dim]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every row of a result this rank made for its share of the call's rows (`t` itself where not split)."""
        return gather_rows(self.comm, t, self.tokens.numel()) if self.split else t

    @property
    def decode_call(self) -> bool:
        """A single-token call after the prompt: where the released code's index-key quirk shows."""
        return isinstance(self.start, int) and self.tokens.numel() == 1 and self.start > 0

    @property
    def eager(self) -> bool:
        return isinstance(self.start, int)


def capture_column(dspark, layer: int) -> tuple[int, int] | None:
    """Layer `layer`'s place among DSpark's target layers (config.dspark), in layer order, and their count:
    its columns of the drafter's input (Step.capture); None where it is not one (or there is no DSpark)."""
    targets = sorted(dspark.target_layer_ids) if dspark else []
    return (targets.index(layer), len(targets)) if layer in targets else None


def begin(state: DecodeState, tokens: torch.Tensor, start, index_keys: str, bound: int | None = None,
          comm=None) -> Step:
    """Start a forward over `tokens`. Eager (`start` None): at the state's length, with exact shapes; `finish`
    advances the length after. Static (`start` a device scalar, or the call's positions as a device vector
    from start, `DecodeState.following`): no host value is read, so the call can be captured in a CUDA
    graph; the visible rows are bounded by `bound` (default: the capacity), a
    promise that no position of the call exceeds it, which the caller keeps. `comm`: the ranks a long call's
    streams are split over by rows (None: held whole)."""
    T = tokens.numel()
    if start is None:
        state.check_room(T)
        start = state.length
        positions = torch.arange(start, start + T, device=tokens.device)
        bound = start + T - 1
    else:
        positions = state.following(start, T)
        start = positions[0]  # a device scalar either way (a view of the given positions: no launch)
        bound = state.capacity - 1 if bound is None else bound
        if not 0 <= bound < state.capacity:
            raise ValueError(f"bound {bound} outside the state's capacity {state.capacity}")
    state.journal_tokens(positions)  # the write is the forward's token inputs' (ops.token_inputs: kernels/embed.py)
    return Step(state, tokens, start, positions, index_keys, bound, comm=comm, share=query_share(comm, T))


def finish(step: Step) -> None:
    count(step.state, step.start, step.tokens.numel())


def count(state: DecodeState, start, n: int) -> None:
    """Who advances a state's length, in one place on the model's side: an eager call or write (`start` a
    host int) counts its `n` positions here; a static one (`start` a device scalar, a captured cycle that
    cannot know how many of its positions are kept) leaves them to the host, which counts what the cycle
    kept from its result (DecodeSession.cycle)."""
    if isinstance(start, int):
        state.advance(n)


@dataclass
class Output:
    # [R, V] float32 (R = T, or 1 with logits="last"); with `sampled`, over ranks, the ranks' columns where they
    # lie (only the samplers read them)
    logits: torch.Tensor | SplitLogits
    step: Step  # the call's (its captures: `hidden`)
    streams: torch.Tensor | None = None  # [T, hc, D] final residual streams (V4's MTP head reads them)

    @property
    def hidden(self) -> torch.Tensor | None:
        """[T, n_targets * D]: DSpark inputs (the captured target-layer streams), made at each read (a
        rank-split call's a gather: the callers read once; a plain cycle reads none, no launch)."""
        step = self.step
        return step.gather(step.hidden) if step.hidden is not None else None


@dataclass
class Draft:
    ids: torch.Tensor  # [k] int64: proposed tokens for positions q+2 .. q+1+k
    logits: torch.Tensor  # [k, V] float32: the distribution each draft was drawn from (before sampling)
    confidence: torch.Tensor | None = None  # [k] raw logits of the confidence head (DSpark)

    @classmethod
    def empty(cls, k: int, vocab: int, device, confidence: bool) -> "Draft":
        """Uninitialized buffers for a draft of `k` tokens, for a drafter called without its caller's (a
        captured cycle passes views of its buffers, so that the draft needs no copy into them)."""
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(k, dtype=torch.long, device=device), torch.empty(k, vocab, **f32),
                   torch.empty(k, **f32) if confidence else None)
