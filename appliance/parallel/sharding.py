"""Splitting a loaded model over the ranks of a process group: a transformation applied after load. The
model code runs unchanged on each rank; what changes is which slices of the weights its modules hold and
the reduce hooks that sum partial results over ranks.

- attention: query heads (`wq_b` rows), their sinks and output groups (`wo_a`) are split; `wo_b` takes
  the rank's columns and its partial sum is all-reduced (a long call's rows: `RowParallel.exchange`, the
  product whole for the rank's share of the rows). The shared KV head (`wkv`, compressors, index
  keys), `wq_a` and the norms are replicated: every head reads the same KV, and they are small.
- indexer: replicated (its query heads `wq_b` and their weights `weights_proj` on every rank, ~8 MB a
  layer): every rank scores every head and selects the same rows as one device would. A decode step
  sends nothing for it; a longer call (a prefill chunk) has each rank score and select a quarter of its
  queries and gathers the selections (V4.1: appliance/model/rowsplit.py; rows x top-k indices, not scores).
  Split heads would send each rank's partial scores of every query and visible key (float32 [T, N]: 354 GB
  a rank for a 4096-token prefill chunk at 855K, `bench model --prefill`) and cost a decode step one
  all-reduce an indexing layer (2.434 -> 2.371 ms a plain cycle on 4 x B300 modeled without it).
- MoE: every expert's intermediate is split (rank r holds rows [r I/n, (r+1) I/n) of each expert's w1 and
  w3 and those columns of its w2, and computes every slot's partial output): each rank reads a 1/n share
  of every selected expert, so no rank waits on a busier one (with whole experts per rank the busiest holds
  1.9x the mean of a plain step's picks: `bench model`'s placement prices both). Where an expert's slice
  would split a scale block (I / n not a multiple of the FP8 block or of FP4's 32 columns) the experts are
  split whole instead (rank r holds experts [r E/n, (r+1) E/n) and computes the slots that chose them).
  The shared expert's intermediate is split too: replicating it would read its 35 MB on every rank and
  every layer, splitting it costs nothing extra because its partial sum travels in the same all-reduce as
  the routed slots (a long call takes it whole for the rank's share of the rows: ExpertReduce). The router
  is replicated (selection must be identical everywhere).
- head (and DSpark's Markov head): vocab-parallel, each rank computes its slice of the logits; they are
  all-gathered, or, where they go only to a sampler (a cycle's steps), its kernel reads every rank's
  columns where they lie (`VocabParallel`), so sampling sees the same logits as a single device.
- embedding, mHC: replicated. Engram: its tables replicated (memory-mapped on the host, shared by the page
  cache of every rank's process); its `wkv` split by outputs for a decode step (each rank its rows' columns
  of the product, gathered in the gates' launch: `EngramSplit`), whole for a long call's rows. A long call
  on the fast path holds its residual streams by rows (appliance/model/step.py `Step.share`): each rank runs
  the mHC sites and Engram on its share of the rows, where its sub-blocks' outputs arrive (the attention's
  product for its rows, the MoE's sums by rows), and gathers each sub-block's input in X's dtype: a quarter
  of the streams' bytes a rank.
On the reference path reductions run in float64 and are rounded once, like the single-device reference:
splitting does not change the function (up to the order of a float64 sum). On the fast path they run in
float32, added in rank order (`Comm.sum`, appliance/parallel/collectives.py): the same bits on every rank
and for every batch shape, so a verify of k+1 rows still equals k+1 single steps; against one rank, within
float32 rounding of each split sum (whole experts' routed slots exactly: each comes from one rank).
"""

import torch
import torch.distributed as dist

from appliance.errors import ApplianceError
from appliance.model.blocks import Dense, GroupedOutput, Linear, MoE
from appliance.model.mtp import MAX_DRAFTS as MTP_MAX_DRAFTS
from appliance.model.rowsplit import ALL_ROWS, query_share
from appliance.parallel.collectives import all_gather
from kernels.sampling import SplitLogits


class Comm:
    """The collectives the shards use (gloo on CPU, NCCL on CUDA). `sum`: the fast path's fixed-order fp32
    sum over ranks (appliance/parallel/collectives.py); `all_reduce`: the reference path's float64 sums."""

    def __init__(self, rank: int, world: int, sum=None, group=None, check=None, later=None):
        self.rank, self.world, self.group = rank, world, group
        self.sum = sum
        # a second exchange of `sum`'s kind, its own buffers: for parts read after other exchanges passed
        # through `sum`'s slots (`gather_later`)
        self.later = later
        self.check = check  # --check-ranks: collectives.CallCheck, called before each collective

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if self.check is not None:
            self.check("all_reduce", t)
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t`, concatenated along `dim`: received into one tensor (along dim 0, the result as
        is; a long call's rows gathered hold no second copy)."""
        if self.check is not None:
            self.check("all_gather", t)
        t = t.contiguous()
        flat = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        all_gather(flat, t.view(-1), group=self.group)
        parts = flat.view(self.world, *t.shape)
        if dim == 0:
            return parts.view(self.world * t.shape[0], *t.shape[1:])
        return torch.cat(list(parts), dim=dim)

    def sum_produced(self, shape: tuple[int, ...], produce, consume):
        """The fast path's fixed-order sum over ranks of the float32 partial of `shape` that `produce(to)`
        makes, inside its consumer: `consume` gets every rank's partial in rank order and adds them as it loads
        them (its kernel's `rank_sum.rank_load`), so the sum takes no launch of its own. The producer writes
        its partial into symmetric memory where the sum takes it there (`to`: kernels/rank_sum.py Publish), else
        returns it (`to` None): parallel/collectives.py `produced_into`."""
        return self.sum.produced_into(shape, produce, consume)

    def gather_produced(self, shape: tuple[int, ...], produce, consume):
        """`sum_produced`'s exchange for a product split by its outputs: `consume` gets every rank's float32
        part of `shape` in rank order and reads each where it lies (a gather, nothing added)."""
        return self.sum.gathered_into(shape, produce, consume)

    def gather_later(self, shape: tuple[int, ...], produce, consume):
        """`gather_produced` through the second exchange (`later`): the parts stay where they lie while the
        first exchange's calls pass through its slots (DSpark's base logits, read by each Markov step after
        that step's own exchange)."""
        return self.later.gathered_into(shape, produce, consume)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        """`t` [world, ...]: this rank's part for each rank -> [world, ...] every rank's part for this one, in
        rank order (one all-to-all)."""
        if self.check is not None:
            self.check("all_to_all", t)
        received = torch.empty_like(t)
        dist.all_to_all_single(received, t.contiguous(), group=self.group)
        return received

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly."""
        if n % self.world:
            raise ValueError(f"{n} does not split over {self.world} ranks")
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per


class RowParallel:
    """A linear layer holding the input columns of this rank: local product unrounded, summed over ranks
    (float64 on the reference path, float32 in rank order on the fast path), rounded once. A long call on the
    fast path (more rows than rowsplit.SPLIT_ROWS: a prefill chunk) holds its streams by rows (model.Step)
    and takes the product whole for its share of the rows instead (`exchange`, `whole`): one device's bits,
    a fifth of the sum's link traffic."""

    def __init__(self, linear: Linear, comm: Comm, start: int, end: int, long_calls: bool = True):
        self.rt = linear.rt
        self.comm = comm
        self.weight = linear.weight.cols(start, end)
        self.act_block = linear.act_block
        self.partial, self.sum = partial_sum(linear.rt, comm)
        # every input column, for a long call's rows (`long_calls`: a module that takes them), on the fast path
        self.whole = linear.weight if self.partial == torch.float32 and long_calls else None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self.rt.ops.linear(x, self.weight, self.act_block, self.partial)
        return self.sum(y, out_dtype=out_dtype or self.rt.dtype)

    def into(self, x: torch.Tensor, consume):
        """The product of x summed over ranks inside `consume`, which takes a sum rounded to the runtime's
        dtype: on the fast path every rank's float32 partial in rank order, added where the consumer loads
        them (Comm.sum_produced: the product published by its kernel over symmetric memory); on the reference
        path the float64 sum, rounded."""
        if self.partial != torch.float32:
            return consume(self(x))
        return self.comm.sum_produced((*x.shape[:-1], self.weight.shape[0]), lambda to: self.rt.ops.linear(
            x, self.weight, self.act_block, self.partial, publish=to), consume)

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, this rank's input columns] of a long call -> [this rank's share of the rows, every input
        column] (rowsplit.query_share): each rank sends each other its share's rows of its columns, in x's
        dtype (an all-to-all of 3/4 of x: for the attention's output 2,048 bfloat16 columns a row, not 5,120
        float32 partials)."""
        rows, world = x.shape[0], self.comm.world
        per = -(-rows // world)
        mine = query_share(self.comm, rows)
        if per * world != rows:
            x = torch.cat((x, x.new_zeros(per * world - rows, x.shape[1])))
        got = self.comm.exchange(x.view(world, per, -1))[:, :mine.stop - mine.start]  # [ranks, rows, columns]
        return got.transpose(0, 1).reshape(mine.stop - mine.start, world * x.shape[1])  # (a last share may be empty)


def partial_sum(rt, comm: Comm):
    """(dtype, sum) of the partial results a split op adds over ranks on `rt`'s path: the reference path's
    float64 all-reduce, the fast path's fixed-order float32 sum (one launch, rounding included). Either sum
    takes `out_dtype` (default: the partials' dtype) and `round_to` (round once to it before storing)."""
    if rt.ops.path != "reference":
        return torch.float32, comm.sum

    def wide_sum(t: torch.Tensor, out_dtype: torch.dtype = torch.float64,
                 round_to: torch.dtype | None = None) -> torch.Tensor:
        s = comm.all_reduce(t)
        return (s if round_to is None else s.to(round_to)).to(out_dtype)

    return torch.float64, wide_sum


class VocabParallel:
    """A dense head holding this rank's slice of the vocabulary; logits are all-gathered into one tensor, or,
    where they go only to samplers' kernels on the fast path, left by columns (kernels/sampling.py
    SplitLogits: the kernels read each rank's columns where they lie), as `sampled` says:
    - "next": read by the next sampler launch, before any other exchange over ranks: the product published
      by its kernel over symmetric memory (all-gathered where it passes a slot, or without it), the sampler
      waiting for it in its launch (the acceptance's programs each gathering its row first): no collective
      launch, no concatenation;
    - "later": read by sampler launches after other exchanges (the first exchange's slots are written
      again): published through the second exchange (`Comm.gather_later`), each sampler's kernel reading
      the rows where they lie;
    - "": one tensor."""

    def __init__(self, head: Dense, comm: Comm):
        start, end = comm.span(head.weight.shape[0])
        self.local = _dense_rows(head, start, end)
        self.comm = comm

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype, sampled: str = ""):
        rt, weight = self.local.rt, self.local.weight
        if sampled not in ("", "next", "later"):
            raise ValueError(f"sampled={sampled!r}: must be '', 'next' or 'later'")
        if not sampled or rt.ops.path == "reference" or out_dtype != torch.float32 or x.dim() != 2:
            return self.comm.all_gather(self.local(x, out_dtype), dim=-1)
        if sampled == "later":
            return self.comm.gather_later((x.shape[0], weight.shape[0]), lambda to: rt.ops.linear(
                x, weight, None, torch.float32, publish=to), SplitLogits)
        return self.comm.gather_produced((x.shape[0], weight.shape[0]), lambda to: rt.ops.linear(
            x, weight, None, torch.float32, publish=to), SplitLogits)


def _linear_rows(lin: Linear, start: int, end: int) -> None:
    lin.weight = lin.weight.rows(start, end)


def shard_attention(attn, comm: Comm, long_calls: bool = True) -> None:
    """Split an attention module's query heads and output groups over the ranks (its indexer stays whole);
    `long_calls`: it takes long calls (not a DSpark stage's), whose output product is whole for a rank's rows."""
    c = attn.cfg
    h0, h1 = comm.span(attn.heads)
    _linear_rows(attn.wq_b, h0 * c.head_dim, h1 * c.head_dim)
    attn.sink = attn.sink[h0:h1]
    attn.heads = h1 - h0
    shard_output(attn.out, comm, long_calls)
    if hasattr(attn, "index_comm"):  # V4.1's: a long call's queries shared out (appliance/model/rowsplit.py)
        attn.index_comm = comm


def _dense_rows(d: Dense, start: int, end: int) -> Dense:
    return Dense(d.rt, d.weight.rows(start, end))


def shard_output(out: GroupedOutput, comm: Comm, long_calls: bool = True) -> None:
    g0, g1 = comm.span(out.groups)
    rank_width = out.wo_a.shape[0] // out.groups  # o-LoRA rank per group
    out.wo_a = out.wo_a.rows(g0 * rank_width, g1 * rank_width)
    if out.rt.ops.path == "reference":
        out.wo_a.grouped64(g1 - g0)
    out.groups = g1 - g0
    out.wo_b = RowParallel(out.wo_b, comm, g0 * rank_width, g1 * rank_width, long_calls)


class ExpertReduce:
    """The expert-parallel MoE's sums over ranks, as kernels/moe.py takes them (`reduce`): `sum_produced`, the
    fast path's fixed-order float32 sum inside its consumer of the partials the down kernel writes
    (Comm.sum_produced); `shared_split`, whether the shared expert's intermediate is split (its partial is
    summed too); called as `reduce(outputs, shared64)`, the reference form's float64 sums.

    A long call (a prefill chunk: `share(rows)` not None) sums by rows instead: each rank sums each row's
    pairs it computed, receives every rank's sums of its share of the rows (`exchange`, an all-to-all),
    combines and expands those rows into the streams it holds (model.Step.share): a quarter of one [rows, D]
    received, not every rank's partials of every pair (kernels/moe.py `_combined_by_shares`). A split shared
    expert is taken whole for those rows (`whole_shared`, the fast path's: every rank holds it, 35 MB a
    layer of V4.1-Flash), so no partial of it travels."""

    def __init__(self, comm, reference, shared_split: bool, whole_shared=None):
        self.comm, self.reference, self.shared_split = comm, reference, shared_split
        self.whole_shared = whole_shared
        self.world = comm.world

    def __call__(self, outputs: torch.Tensor, shared64: torch.Tensor | None):
        return self.reference(outputs, shared64)

    def share(self, rows: int) -> tuple[int, int, int] | None:
        """(rows a share is padded to, this rank's first row, its end) of a long call; None: a decode step's
        call, summed whole."""
        mine = query_share(self.comm, rows)
        if mine == ALL_ROWS:
            return None
        return -(-rows // self.world), mine.start, mine.stop

    def sum_produced(self, shape: tuple[int, ...], produce, consume):
        return self.comm.sum_produced(shape, produce, consume)

    def exchange(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.exchange(t)



def shard_moe(moe: MoE, comm: Comm, experts: str = "auto", long_calls: bool = True) -> None:
    """`experts` (RunOptions.experts): split every expert by its intermediate, or hold whole experts; auto:
    split where the slices keep the scale blocks whole. `long_calls`: the MoE takes long calls (not a DSpark
    stage's), whose rows take a split shared expert whole (ExpertReduce.whole_shared)."""
    split = _splits_intermediate(moe.experts[0], comm)
    if experts == "split" and not split:
        w1 = moe.experts[0][0]
        raise ApplianceError(f"--experts split: an expert's intermediate of {w1.shape[0]} does not split over "
                             f"{comm.world} ranks in whole scale blocks; use --experts whole or auto",
                             field="experts", value=experts)
    if split and experts != "whole":
        i0, i1 = comm.span(moe.experts[0][0].shape[0])
        moe.experts = [(w1.rows(i0, i1), w2.cols(i0, i1), w3.rows(i0, i1)) for w1, w2, w3 in moe.experts]
    else:
        e0, e1 = comm.span(len(moe.experts))
        moe.experts = [w if e0 <= e < e1 else None for e, w in enumerate(moe.experts)]
    whole_shared = None
    if moe.shared is not None and _splits(moe.shared[0], comm):
        w1, w2, w3 = moe.shared
        i0, i1 = comm.span(w1.shape[0])
        if long_calls and moe.rt.ops.path != "reference":  # a long call's rows take it whole
            whole_shared = moe.shared
        moe.shared = (w1.rows(i0, i1), w2.cols(i0, i1), w3.rows(i0, i1))
        shared_split = True
    else:  # replicated: every rank computes the whole shared expert, nothing to sum
        shared_split = False

    def reference(outputs: torch.Tensor, shared64: torch.Tensor | None):
        if shared64 is None or not shared_split:
            return comm.all_reduce(outputs), shared64
        packed = torch.cat((outputs.double(), shared64.unsqueeze(1)), dim=1)  # one collective for both
        packed = comm.all_reduce(packed)
        return packed[:, :-1].to(outputs.dtype), packed[:, -1]  # float64 slices of split experts stay unrounded

    moe.reduce = ExpertReduce(comm, reference, shared_split, whole_shared)


class EngramSplit:
    """An Engram layer's `wkv` split by its outputs for a decode step's call (kernels/engram.py fast_layer
    `split`): this rank's rows [rank width, rank width + n) of it (`weight`, a view: a long call's rows take
    wkv whole), every rank's columns of the product gathered in its gates' launch (`gather_produced`)."""

    def __init__(self, wkv, comm: Comm):
        blocks, block = self.blocks(wkv)
        self.width = -(-blocks // comm.world) * block  # whole scale blocks a rank, the last rank the rest
        start = comm.rank * self.width
        self.weight = wkv.rows(start, min(wkv.shape[0], start + self.width))
        self.comm = comm

    @staticmethod
    def blocks(wkv) -> tuple[int, int]:
        """(wkv's row blocks, rows a block): FP8's scale blocks, else single rows."""
        block = wkv.block[0] if wkv.format == "fp8" else 1
        return -(-wkv.shape[0] // block), block

    @staticmethod
    def fits(wkv, world: int) -> bool:
        """Whether every rank holds at least one block of wkv's rows."""
        blocks, _ = EngramSplit.blocks(wkv)
        return blocks - (world - 1) * -(-blocks // world) > 0

    def gather_produced(self, shape, produce, consume):
        return self.comm.gather_produced(shape, produce, consume)


def shard_engram(engram, comm: Comm) -> None:
    """Split a fast-path Engram layer's `wkv` by its outputs for decode steps (`EngramSplit`), where every rank
    gets whole scale blocks: a rank reads a quarter of it (V4.1-Flash: 157 MB a layer whole)."""
    wkv = engram.wkv.weight
    if wkv is not None and engram.rt.ops.path != "reference" and EngramSplit.fits(wkv, comm.world):
        engram.split = EngramSplit(wkv, comm)


def shard(model, drafter, comm: Comm, experts: str = "auto") -> list[str]:
    """Split `model` (and its drafter) in place for this rank, the MoE's experts as `experts` says
    (`shard_moe`). Returns why the split model's steps cannot be captured in CUDA graphs (empty when they
    can)."""
    for layer in model.layers:
        shard_attention(layer.attn, comm)
        shard_moe(layer.ffn, comm, experts)
        if getattr(layer, "engram", None) is not None:
            shard_engram(layer.engram, comm)
    head = VocabParallel(model.head, comm)
    model.head = head
    for m in (model, drafter):  # the fast path's long calls hold their streams by rows (model.Step)
        if hasattr(m, "row_comm") and model.rt.ops.path != "reference":
            m.row_comm = comm
    # the reference form reads the selected experts on the host; the fast path's fused kernels do not
    blockers = [EP_MOE_BLOCKER] if model.rt.ops.path == "reference" else []
    if drafter is None:
        return blockers
    drafter.head = head  # the drafter shares the backbone's head
    long_calls = hasattr(drafter, "row_comm")  # MTP's commit is one; DSpark's blocks are a few rows
    for block in getattr(drafter, "stages", None) or [drafter.block]:
        shard_attention(block.attn, comm, long_calls)
        shard_moe(block.ffn, comm, experts, long_calls)
    if hasattr(drafter, "markov_head"):
        drafter.markov_head = VocabParallel(drafter.markov_head, comm)
    return blockers + ["the drafter's expert-parallel MoE runs the same reference form"] if blockers else []


EP_MOE_BLOCKER = ("the expert-parallel MoE on the reference path reads the selected experts on the host (the fast "
                  "path, --path fast, runs it on the fused kernels)")


def largest_sum(cfg, rows: int, context: int) -> int:
    """The most float32 values one fast-path sum over ranks takes in a forward of `rows` rows at `context`
    positions: the MoE's rows (rows x 2 x dim: each row's routed pairs summed, a split shared expert's
    partial; kernels/moe.py `_row_sums_into`), the indexer's head-summed scores (rows x the compressed rows it
    scores, at most context over the smallest ratio), an output projection (rows x dim), a rank's columns of
    an Engram layer's product (rows x (hc + 1) dim / world, in whole scale blocks: at most half of it and a
    block on two ranks or more, `EngramSplit`), a rank's columns of the logits a sampler reads where they lie
    (rows x vocab / world: at most half of them, `VocabParallel`). A symmetric-memory sum of this capacity
    takes every call of a decode cycle in one piece (parallel/collectives.py)."""
    ratios = [r for r in cfg.compress_ratios if r]
    scored = context // min(ratios) + 1 if ratios else 0
    block = cfg.weight_block[0] if cfg.weight_block else 1
    engram = (cfg.hc_mult + 1) * cfg.dim // 2 + block if getattr(cfg, "engram", None) is not None else 0
    return rows * max(cfg.dim * 2, scored, engram, -(-cfg.vocab_size // 2))


def verify_rows(cfg, drafter: bool) -> int:
    """The most rows one decode forward takes with the checkpoint's drafter: the anchor and DSpark's block
    (adaptive drafts up to it) or MTP's most drafts."""
    if not drafter:
        return 1
    return 1 + (cfg.dspark.block_size if cfg.dspark is not None else MTP_MAX_DRAFTS)


def _splits_intermediate(expert: tuple, comm: Comm) -> bool:
    """Whether an expert (w1, w2, w3) splits by its intermediate over the ranks in whole scale blocks: w1's
    and w3's output rows, w2's input columns."""
    w1, w2, _ = expert
    per = w1.shape[0] // comm.world
    cols = {"fp8": w2.block[1] if w2.block else 1, "fp4": 32}.get(w2.format, 1)
    return _splits(w1, comm) and per % cols == 0


def _splits(w, comm: Comm) -> bool:
    """Whether a weight's output rows split over the ranks in whole FP8 blocks."""
    rows = w.shape[0]
    block = w.block[0] if w.format == "fp8" else 1
    return rows % comm.world == 0 and (rows // comm.world) % block == 0
