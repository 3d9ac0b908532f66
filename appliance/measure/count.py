"""One decode cycle of a session, counted (the numbers `appliance bench forward --json` and `appliance bench
model` report): launches per cycle and per layer, host syncs, collectives, and bytes read against the ideal.

`count_cycle(session, context)` runs the session's cycle steps (plain, or draft + verify) once to warm up
(caches a first call makes, as a capture's warm-up would) and once under the `Recorder`, with
- every backbone layer and drafter stage tagged, so what happens inside is attributed to it;
- the registry's `attention`, `query_inputs`, `window_keys`, `compress` and `ffn` wrapped to declare what they
  read that the recorder cannot see from the tensors a kernel receives: the compressed-row cache is read at
  the distinct rows the index selects (not the whole cache), rings at the slots in reach, the RoPE tables at
  the rows of the call's positions (not the whole capacity), and the fused MoE kernels read each distinct
  routed expert this rank holds once, and the shared expert (this rank's share), through tables of expert
  addresses. On the meta device (no values) the distinct counts are their expected values: every selected
  compressed row distinct (at most the visible rows), and the routed experts of W rows under uniform
  routing, E (1 - (1 - k/E)^W) (a real run counts the routing it did).

`count_prefill(model, state, start, chunk)` counts one eager prefill chunk of a meta build the same way (the
wrappers also declare the tensor-core FLOPs of the weight products, the attention and the indexer's scores,
which a chunk's rows make matter), with the most bytes its own tensors hold at once (`scratch_bytes`).

The ideal the bytes are held against: appliance/measure/ideal.py.
"""

import dataclasses
import math
from collections import defaultdict
from contextlib import ExitStack, contextmanager

import torch

from appliance.parallel.placement import HOST_TABLE_BYTES
from kernels._triton import E4M3_LONG_ROWS, E4M3_MMA_ROWS, LONG_ROWS, MMA_ROWS, long_calls
from kernels.indexer import SELECT_PASSES, inside_rows

from .ideal import ideal_bytes
from .recorder import LiveBytes, Recorder, nbytes, tensor_args, unique_violations
from .tiles import engram_kind, expand_kind, expected_tile_rows, one_product_kind, products_kind, query_kind, tile_rows


def expected_distinct(n_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts selected by `rows` rows of top-k under uniform routing."""
    return n_experts * (1 - (1 - top_k / n_experts) ** rows)


class _Tagged:
    """A block (layer or stage) whose calls are attributed to `name`; everything else passes through."""

    def __init__(self, inner, rec: Recorder, name: str, calls: dict):
        self.__dict__.update(_inner=inner, _rec=rec, _name=name, _calls=calls)

    def __call__(self, *args, **kwargs):
        if self._rec.recording:
            self._calls[self._name] += 1
        with self._rec.tag(self._name):
            return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)


@contextmanager
def tagged(model, drafter, rec: Recorder, calls: dict):
    """Tag the backbone's layers `layer i` and the drafter's stages `stage s` while inside."""
    layers = model.layers
    saved_layers = list(layers)
    layers[:] = [_Tagged(b, rec, f"layer {i}", calls) for i, b in enumerate(saved_layers)]
    stages = getattr(drafter, "stages", None) if drafter is not None else None
    saved_stages = list(stages) if stages is not None else None
    block = getattr(drafter, "block", None) if drafter is not None and stages is None else None
    if stages is not None:
        stages[:] = [_Tagged(b, rec, f"stage {s}", calls) for s, b in enumerate(saved_stages)]
    elif block is not None:
        drafter.block = _Tagged(block, rec, "stage 0", calls)
    try:
        yield
    finally:
        layers[:] = saved_layers
        if stages is not None:
            stages[:] = saved_stages
        elif block is not None:
            drafter.block = block


class DeclaredReads:
    """The registry ops wrapped to declare their gathers (see the module docstring); logs what they read."""

    def __init__(self, rt, rec: Recorder, meta: bool):
        self.rt, self.rec, self.meta = rt, rec, meta
        self.rows_read: dict[str, int] = defaultdict(int)  # block -> compressed-row bytes the attention reads
        self.routed: dict[str, int] = defaultdict(int)  # block -> routed expert bytes (distinct, held)
        self.host_reads: list[int] = []  # bytes each launch of the cycle reads from host memory (Engram rows)

    @contextmanager
    def installed(self):
        ops = self.rt.ops
        import dataclasses

        rows, tokens = (lambda x: x.reshape(-1, x.shape[-1]).shape[0]), (lambda X: X.shape[0])
        self.rt.ops = dataclasses.replace(ops, attention=self._attention(ops.attention),
                                          attend=self._attend(ops.attend),
                                          query_inputs=self._query_inputs(ops.query_inputs, rows),
                                          window_keys=self._window_keys(ops.window_keys),
                                          compress=self._compress(ops.compress), ffn=self._ffn(ops.ffn),
                                          engram_lookup=self._engram_lookup(ops.engram_lookup),
                                          linear=self._products(ops.linear, rows, one_product_kind),
                                          linear_multi=self._products(ops.linear_multi, rows, products_kind),
                                          linear_expand=self._products(ops.linear_expand, rows, expand_kind),
                                          engram=self._products(ops.engram, tokens, engram_kind),
                                          index_scores=self._index_scores(ops.index_scores),
                                          index_select=self._index_select(ops.index_select),
                                          sample_sum=self._sample_sum(ops.sample_sum),
                                          token_inputs=self._token_inputs(ops.token_inputs),
                                          put_rows=self._put_rows(ops.put_rows))
        try:
            yield
        finally:
            self.rt.ops = ops

    @contextmanager
    def _rows_read(self, comp_kv, comp_index):
        """Inside, a launch reads the compressed-row cache at the distinct rows `comp_index` selects."""
        rec = self.rec
        if comp_kv is None or comp_index is None or comp_index.numel() == 0:
            yield
            return
        row_bytes = self._distinct_rows(comp_kv, comp_index) * _row(comp_kv)
        if rec.recording:
            self.rows_read[rec.block] += row_bytes
        with rec.gather(comp_kv, row_bytes):
            yield

    def _distinct_rows(self, cache, index) -> int:
        """How many distinct rows of `cache` `index` (-1 = none) names (a meta build: as many as it can)."""
        with self.rec.pause():
            return min(cache.shape[0], index.numel()) if self.meta else int(index[index >= 0].unique().numel())

    @contextmanager
    def _table_rows(self, rope, rows: int):
        """Inside, a launch reads `rows` rows of the RoPE tables (cos, sin) [P, r/2], one per position it
        rotates, not the tables (which cover the whole capacity)."""
        cos, sin = rope
        with self.rec.gather(cos, rows * _row(cos)), self.rec.gather(sin, rows * _row(sin)):
            yield

    def _attention(self, attention):
        def call(q, window_kv, window_mask, comp_kv, comp_index, sink, scale, p_dtype=None, positions=None,
                 rope=None):
            with self._rows_read(comp_kv, comp_index), self._table_rows(rope, q.shape[0]) if rope else ExitStack():
                return attention(q, window_kv, window_mask, comp_kv, comp_index, sink, scale, p_dtype, positions,
                                 rope)

        return call

    def _attend(self, attend):
        """V4.1's attention reads the window's rows of its ring (not the spare slots) and the selected rows;
        each query multiplies its window and its selected rows, scores and values (its head dimension each)."""
        rec = self.rec

        def call(q, ring, keys, positions, window, comp_kv, comp_index, sink, scale, p_dtype, rope):
            first = len(rec.launches)
            with self._rows_read(comp_kv, comp_index), rec.gather(ring, min(ring.shape[0], window) * _row(ring)), \
                    self._table_rows(rope, q.shape[0]):
                out = attend(q, ring, keys, positions, window, comp_kv, comp_index, sink, scale, p_dtype, rope)
            selected = comp_index.shape[-1] if comp_index is not None else 0
            t, h, d = q.shape
            self._declare(first, "attention", 4 * t * h * d * (window + selected))
            return out

        return call

    def _index_scores(self, scores):
        """The indexer scores every visible key row for every query and head (the rows past a query's own
        are masked after they are computed); a re-indexing layer the rows of its candidate blocks, of which
        it reads the distinct ones (as attention its selected rows)."""
        rec = self.rec

        def call(q, w, keys, *rest, inside=None, block=1, **kwargs):
            first = len(rec.launches)
            with ExitStack() as reads:
                if inside is not None:  # the ideal counts these keys as the state's (state_ideal)
                    with rec.pause():
                        rows = inside_rows(inside, block)
                    reads.enter_context(rec.gather(keys, self._distinct_rows(keys, rows) * _row(keys)))
                out = scores(q, w, keys, *rest, inside=inside, block=block, **kwargs)
            m, nh, di = q.shape
            scored = inside.shape[1] * block if inside is not None else keys.shape[0]
            self._declare(first, "attention", 2 * m * nh * scored * di)
            return out

        return call

    def _index_select(self, select):
        """The selection kernel reads its scores once a pass (indexer.SELECT_PASSES), and at the candidate
        source as many times again choosing the blocks (their maxima read from the scores, or given)."""
        rec = self.rec

        def call(scores, k, positions=None, ratio=1, block=0, top_blocks=0, inside=None):
            first = len(rec.launches)
            out = select(scores, k, positions, ratio, block, top_blocks, inside)
            kernel = [la for la in rec.launches[first:] if la.kind == "triton"]
            if rec.recording and kernel:  # counted once as it was received
                times = SELECT_PASSES * ((min(k, scores.shape[1]) > 0) + (top_blocks > 0))
                kernel[-1].bytes_read += (times - 1) * nbytes(scores)
            return out

        return call

    def _sample_sum(self, sample_sum):
        """DSpark's Markov step reads its table (the Markov embedding, 132 MB in V4.1-Flash) at the row of
        each token it draws, not the table; a base left in symmetric memory (parallel/sharding.py
        Comm.gather_later) it reads from the peers' buffers: the "symm_read" of its part (over the link, no
        wait of its own: the step's wait for its addend covers it, published after the base on every rank)."""
        def call(base, addend, params, key, out, total, table=None, next_row=None):
            if getattr(getattr(base, "parts", None), "published", None) is not None:
                self.rec.collective("symm_read", base.parts[0])
            with self.rec.gather(table, out.numel() * _row(table)) if table is not None else ExitStack():
                return sample_sum(base, addend, params, key, out, total, table, next_row)

        return call

    def _token_inputs(self, token_inputs):
        """A forward's token inputs read the embedding table (1.3 GB in V4.1-Flash) at the rows of the tokens
        they embed, not the table, and write the token history at the call's positions, reading none of it."""
        rec = self.rec

        def call(tokens, positions, history, table, copies, dtype, share=slice(None), out=None, also=None):
            rows = len(range(tokens.numel())[share])
            with ExitStack() as declared:
                declared.enter_context(rec.gather(table, rows * _row(table)))
                if also is not None:  # a second table's rows (DSpark's Markov embedding)
                    declared.enter_context(rec.gather(also[0], rows * _row(also[0])))
                if history is not None:
                    declared.enter_context(rec.writes(history, tokens.numel() * history.element_size()))
                return token_inputs(tokens, positions, history, table, copies, dtype, share, out, also)

        return call

    def _put_rows(self, put_rows):
        """Rows written into a ring write its slots (the values' rows), reading none of it."""
        def call(data, slots, values):
            with self.rec.writes(data, slots.numel() * _row(data)):
                return put_rows(data, slots, values)

        return call

    def _products(self, op, rows_of, kind_of):
        """A weight product's tensor-core FLOPs: each launch's quantized weight elements times its rows,
        padded to the MMA's (`rows_of` the first argument: x [..., K] or the Engram streams [T, hc, D]), and
        how it multiplies: `kind_of(x, *args)` gives its path (Launch.path), whether it can run as a long
        call's (then also `products_long`: padded to LONG_ROWS) and the bytes its rows' staging then moves (a
        list of those with the products each launch computes where one call launches several). What a product
        writes is its outputs: the float32 partials of a split-K are left out (no launch of a long
        call takes one; a GPU's, of a decode step's 16 rows, are read back from L2 by the tile's last
        program, and the count's under the interpreter are its own)."""
        rec = self.rec

        def call(x, *args, **kwargs):
            first = len(rec.launches)
            out = op(x, *args, **kwargs)
            if rec.recording:
                rows = rows_of(x)
                launches = [la for la in rec.launches[first:] if la.weights]
                kinds = kind_of(x, *args)
                kinds = [(*kinds, None)] * len(launches) if isinstance(kinds, tuple) else kinds
                for la, (path, long, staged, ix) in zip(launches, kinds, strict=True):
                    outs = (out,) if ix is None else [out[i] for i in ix]
                    la.path, la.bytes_written = path, sum(nbytes(t) for t in tensor_args(outs))
                    la.flops["products"] = 2 * _mma_rows(rows) * sum(la.weights.values())
                    if path == "native":  # the e4m3 MMA's programs of 8 (sm_89/90)
                        la.flops["products_e4m3"] = 2 * _mma_rows(rows, E4M3_MMA_ROWS) * sum(la.weights.values())
                    if long:
                        la.flops["products_long"] = 2 * _mma_rows(rows, LONG_ROWS) * sum(la.weights.values())
                        la.staged_bytes = staged
                    if long and path == "native":
                        la.flops["products_long_e4m3"] = 2 * _mma_rows(rows, E4M3_LONG_ROWS) * sum(
                            la.weights.values())
            return out

        return call

    def _declare(self, first: int, kind: str, flops: float) -> None:
        """`flops` of `kind` to the (last) Triton launch the op made since launch `first`."""
        launches = [la for la in self.rec.launches[first:] if la.kind == "triton"] or self.rec.launches[first:]
        if self.rec.recording and launches:
            launches[-1].flops[kind] = launches[-1].flops.get(kind, 0) + flops

    def _query_inputs(self, query_inputs, rows_of):
        """The query products' weights and outputs (`_products`); the row work's ring written at the call's
        positions where it writes it (not read), the RoPE tables read at them."""
        rec = self.rec
        products = self._products(query_inputs, rows_of, query_kind)

        def call(x, prods, norm, kv, positions, rope, kv_norm, eps, ring, write, *rest):
            first = len(rec.launches)
            written = min(positions.numel(), ring.shape[0]) * _row(ring) if write else 0
            with rec.writes(ring, written), self._table_rows(rope, positions.numel()):
                out = products(x, prods, norm, kv, positions, rope, kv_norm, eps, ring, write, *rest)
            if rec.recording and len(rec.launches) == first + 1:  # one launch: `_products` set its outputs
                rec.launches[first].bytes_written += written
            return out

        return call

    def _window_keys(self, window_keys):
        """As `_query_inputs`' row work, each of the call's rings."""
        def call(kvs, positions, rope, kv_norms, eps, rings, quant):
            rows = min(positions.numel(), rings[0].shape[0])
            with ExitStack() as declared:
                for ring in rings:
                    declared.enter_context(self.rec.writes(ring, rows * _row(ring)))
                declared.enter_context(self._table_rows(rope, positions.numel()))
                return window_keys(kvs, positions, rope, kv_norms, eps, rings, quant)

        return call

    def _compress(self, compress):
        """The compressor reads a group's slots of its ring; the row caches are written (a row a group the call
        completes), not read."""
        rec = self.rec

        def call(kappa, zeta, positions, ring, ratio, norm, eps, wk, k_norm, rope, kv_rows, key_rows, *rest):
            rows = -(-positions.numel() // ratio)
            with rec.gather(ring, min(ring.shape[0], ratio) * _row(ring)), rec.writes(kv_rows, rows * _row(kv_rows)), \
                    rec.writes(key_rows, rows * _row(key_rows)), self._table_rows(rope, positions.numel()):
                return compress(kappa, zeta, positions, ring, ratio, norm, eps, wk, k_norm, rope, kv_rows, key_rows,
                                *rest)

        return call

    def _engram_lookup(self, lookup):
        """The lookup reads each table (~100 GB in host memory) at the rows it looks up, not the table, and
        the token history and the token map at the n-gram's positions."""
        rec = self.rec

        def call(tokens, positions, token_map, pad, mult, primes, offsets, n_heads, tables, scales):
            rows = positions.numel() * primes.shape[1]
            grams = positions.numel() * mult.shape[1]
            with ExitStack() as declared:
                for t in (*tables, *scales):
                    declared.enter_context(rec.gather(t, rows * _row(t)))
                for t in (tokens, token_map):
                    declared.enter_context(rec.gather(t, grams * t.element_size()))
                host = sum(rows * _row(t) for t in (*tables, *scales) if _on_host(t, positions))
                first = len(rec.launches)
                out = lookup(tokens, positions, token_map, pad, mult, primes, offsets, n_heads, tables, scales)
                if rec.recording and host:
                    self.host_reads.append(host)
                    copying = [la for la in rec.launches[first:] if la.kind == "triton"] or rec.launches[first:]
                    if copying:  # the launch that copies the rows (the kernel; on the reference path the last)
                        copying[-1 if copying[0].kind == "torch" else 0].host_bytes = host
                return out

        return call

    def _ffn(self, ffn):
        rec = self.rec

        def call(x, gate, bias, top_k, score_func, route_scale, norm_eps, hash_idx, experts, shared, act_block, limit,
                 weight_before_w2, X, post, comb, reduce=None, pending=False):
            held = [e for e in experts if e is not None]
            first = len(rec.launches)
            args = (x, gate, bias, top_k, score_func, route_scale, norm_eps, hash_idx, experts, shared, act_block,
                    limit, weight_before_w2, X, post, comb)
            out = ffn(*args, reduce=reduce, pending=pending)
            indices = out[2]
            with rec.pause():
                if self.meta:
                    distinct = expected_distinct(len(experts), top_k, x.shape[0])
                    n = distinct * len(held) / len(experts)
                else:
                    n = sum(1 for e in indices.unique().tolist() if experts[e] is not None)
            if rec.recording:
                self.routed[rec.block] += int(n * sum(w.nbytes for w in held[0])) if held else 0
                _expert_reads(rec.launches[first:], held[0] if held else (), n, shared or (),
                              (len(experts), top_k, x.shape[0]), len(held) < len(experts))
                # each held routed expert's rows are its pairs, padded to whole tiles; the shared expert takes
                # every row
                long = act_block is not None and act_block >= 32  # in the checkpoint's formats: can run long
                for la in rec.launches[first:]:
                    la.path = ("native" if long else "registers") if la.weights else ""
                    la.phase_waits = 2 if STEP in la.name else 0
                all_pairs = x.shape[0] * (top_k + (shared is not None))
                tiles = ((MMA_ROWS, "products"), (E4M3_MMA_ROWS, "products_e4m3"), (LONG_ROWS, "products_long"),
                         (E4M3_LONG_ROWS, "products_long_e4m3"))
                for tile, kind in tiles if long else tiles[:1]:
                    with rec.pause():
                        per_expert = (expected_tile_rows(len(experts), top_k, x.shape[0], tile) if self.meta else
                                      tile_rows(indices, [e is not None for e in experts], tile))
                    every = _mma_rows(x.shape[0], tile)
                    for la in rec.launches[first:]:
                        routed = sum(la.routed_weights.values())
                        if la.weights:
                            la.flops[kind] = 2 * (per_expert * routed + every * (sum(la.weights.values()) - routed))
                for la in rec.launches[first:] if long else ():  # x's rows staged for gate and up, h's for down
                    if la.weights:
                        width = x.shape[1] if "gate_up" in la.name else held[0][1].shape[1] if held else 0
                        la.staged_bytes = (x.shape[0] if "gate_up" in la.name else all_pairs) * width * (
                            x.element_size() + 1)
            return out

        return call


def _mma_rows(rows: float, tile: int = MMA_ROWS) -> int:
    """Rows a product computes for `rows`: whole tiles of the MMA's (a decode step's 16 however many it uses;
    a long call's LONG_ROWS)."""
    return math.ceil(rows / tile) * tile


# A decode step's router, gate and up, and down: phases of one launch (kernels/moe.py), two waits between them
STEP = "moe._step_kernel"


def _expert_reads(launches: list, expert: tuple, n: float, shared: tuple, routing: tuple[int, int, int],
                  whole: bool) -> None:
    """What the fused MoE kernels read through their tables of expert addresses: w1 and w3 (gate and up) in
    the gate/up launch, w2 in the down launch (a decode step's: both in its one launch, STEP), of `n` routed
    experts like `expert` and of the shared one;
    `routing`: (experts, top-k, rows) of the call; `whole`: the ranks hold whole experts (a share of each
    otherwise: no rank is busier)."""
    for kernel, picked in (("gate_up", (0, 2)), ("down", (1,))):
        fused = next((la for la in launches if la.kind == "triton" and (kernel in la.name or STEP in la.name)), None)
        if fused is None:
            continue
        fused.routing, fused.whole_experts = routing, whole
        for weights, times, routed in ((expert, n, True), (shared, 1, False)):
            for w in (weights[i] for i in picked if i < len(weights)):
                fused.bytes_read += int(times * w.nbytes)
                fused.routed_bytes += int(times * w.nbytes) if routed else 0
                if w.format in ("fp8", "fp4"):
                    elements = int(times * w.shape[0] * w.shape[1])
                    fused.weights[w.format] = fused.weights.get(w.format, 0) + elements
                    if routed:
                        fused.routed_weights[w.format] = fused.routed_weights.get(w.format, 0) + elements


def _row(t: torch.Tensor) -> int:
    return t.shape[-1] * t.element_size()


def _on_host(table: torch.Tensor, beside: torch.Tensor) -> bool:
    """Whether `table` is read from host memory by a device holding `beside`: it is on the host while the
    model is not, or (a CPU or meta build) placement would leave it there."""
    if table.device.type == "cpu" and beside.device.type not in ("cpu", "meta"):
        return True
    return beside.device.type in ("cpu", "meta") and table.numel() * table.element_size() > HOST_TABLE_BYTES


def _reach_for(reaches: list[int], end: int) -> int:
    return next(r for r in reaches if end <= r)


def cycle_keys(session, context: int) -> list[tuple]:
    """The cycle steps one decode cycle at `context` replays (the session's graph keys)."""
    spec = session.spec
    if spec is None:
        return [("plain", 0, _reach_for(session.reaches, context + 1))]
    if spec.adaptive:
        return [("draft", spec.block, None), ("verify", spec.k + 1, _reach_for(session.reaches, context + spec.k + 1))]
    return [("fixed", spec.k, _reach_for(session.reaches, context + spec.k + 1))]


def count_cycle(session, context: int | None = None, world: int = 1, seed: int = 0) -> dict:
    """Count one decode cycle of `session` after `context` positions (prefilled with random ids, or on the
    meta device only declared; None: at the state's length, as it is). `world`: ranks the model is split
    over (for this rank's share of the ideal). Leaves the session's committed length at `context`."""
    spec, state, buf = session.spec, session.state, session.buffers
    meta = session.device.type == "meta"
    width = 1 + (spec.k if spec is not None else 0)
    if context is None:
        if meta:
            raise ValueError("a meta session has no prefilled state: give the context")
        context = state.length
    elif context + width > session.capacity:
        raise ValueError(f"context {context} + {width} rows exceed the session's capacity {session.capacity}")
    if meta:
        state.length = context
        if spec is not None:
            spec.state.length = max(context - 1, 0)
    elif context != state.length:
        g = torch.Generator().manual_seed(seed)
        session.prefill_all(torch.randint(0, session.cfg.vocab_size, (max(context, 1),), generator=g).tolist())
        context = state.length
    if not meta and spec is not None:
        spec.catch_up(context)  # the drafter as session.cycle leaves it for a cycle (a one-off write: not counted)
    keys = cycle_keys(session, context)
    rec = Recorder(meta=meta, recording=False)
    reads = DeclaredReads(session.model.rt, rec, meta)
    calls: dict[str, int] = defaultdict(int)
    drafter = spec.drafter if spec is not None else None
    with torch.inference_mode(), rec, tagged(session.model, drafter, rec, calls), reads.installed():
        for recording in (False, True):
            rec.recording = recording
            for key in keys:
                with rec.pause():  # what the host writes before a replay
                    buf.load(1, context)
                rec.label = key[0]
                session.graphs.runners[key].step()
    s = rec.summary()
    layers = {b: v for b, v in s["by_block"].items() if b.startswith("layer ")}
    stages = {b: v for b, v in s["by_block"].items() if b.startswith("stage ")}
    per_layer = [layers.get(f"layer {i}", {}).get("launches", 0) for i in range(len(session.model.layers))]
    per_stage = [v["launches"] / max(calls[b], 1) for b, v in sorted(stages.items())]
    ideal = ideal_bytes(session.cfg, world, width, spec is not None, sum(reads.routed.values()),
                        sum(reads.rows_read.values()), state, context, spec.state if spec is not None else None)
    total = s["bytes_read"]
    return {
        "cycle": "plain" if spec is None else f"{'adaptive' if spec.adaptive else spec.drafter.kind} k={spec.k}",
        "context": context, "width": width, "reach": keys[-1][2],
        "launches_per_cycle": s["launches"],
        "launches_per_layer": max(per_layer) if per_layer else 0,
        "launches_by_layer": per_layer,
        "launches_per_draft_stage": max(per_stage) if per_stage else None,
        "draft_stage_calls": sum(calls[b] for b in stages),
        "launches_outside_layers": s["by_block"].get("outside", {}).get("launches", 0),
        "torch_launches": s["torch_launches"], "triton_launches": s["triton_launches"],
        "host_syncs_per_cycle": s["host_syncs"],
        "float64_launches_per_cycle": s["float64_launches"],
        "float64_sites": float64_sites(rec.float64),
        "host_reads_between_steps": len(keys),  # each step's result copied back (by design)
        # the device's reads of host memory inside the cycle (the Engram rows), over the host link
        "host_link": {"bytes_per_cycle": sum(reads.host_reads), "launches_per_cycle": len(reads.host_reads)},
        "collectives": {"per_cycle": s["collectives"],
                        "per_layer": max((v["collectives"] for v in layers.values()), default=0),
                        "payloads": payloads(rec.collectives)},
        "bytes_per_step": {"total": total, "written": s["bytes_written"], "ideal": ideal["total"],
                           "ratio": total / ideal["total"],
                           "ideal_parts": ideal, "by_block": {b: v["bytes_read"] for b, v in s["by_block"].items()}},
        "capture_violations": unique_violations(rec.violations),
        "torch_ops": s["torch_ops"], "triton_kernels": s["triton_kernels"],
        "launches": [dataclasses.asdict(la) for la in rec.launches],  # in order: what the cost model prices
    }


def last_chunk_start(prompt: int, chunk: int) -> int:
    """Where a `prompt`-token prompt's last prefill chunk starts, its chunks taken whole from 0."""
    return (-(-prompt // chunk) - 1) * chunk


def count_prefill(model, state, start: int, chunk: int) -> dict:
    """Count one eager prefill chunk of `chunk` positions after `start` by `model` built on the meta device
    into its `state` (sized, not allocated; only declared at that length; a first chunk of 16 warms the
    caches up): its launches, collectives, bytes and tensor FLOPs, in count_cycle's shape for the cost model.
    The chunk commits as a prefill's does (DecodeState.committing): its journal keeps what its last `spare`
    positions overwrite, counted in the scratch twice (the previous chunk's is still held)."""
    if torch.device(state.device).type != "meta":
        raise ValueError("count_prefill counts a meta build (its state only declared)")
    if start + chunk > state.capacity:
        raise ValueError(f"start {start} + chunk {chunk} exceed the state's capacity {state.capacity}")
    rec = Recorder(meta=True, recording=False)
    reads = DeclaredReads(model.rt, rec, True)
    calls: dict[str, int] = defaultdict(int)
    with torch.inference_mode(), rec, tagged(model, None, rec, calls), reads.installed(), long_calls():
        for recording, rows in ((False, min(chunk, 16)), (True, chunk)):
            state.length = start
            rec.recording = recording
            rec.memory = LiveBytes() if recording else None
            with state.committing(start + rows) if recording else state.journal.off():
                model.forward(torch.zeros(rows, dtype=torch.long, device=state.device), state, logits="last")
    # the journal of a chunk's last `spare` positions lives through the next chunk: the previous chunk's, as
    # large as this one's, is held while this one runs
    journal = sum(t.untyped_storage().nbytes() for e in state.journal.entries for t in e[1:4])
    state.journal.entries.clear()
    state.length, state.journal_floor = start, 0
    s = rec.summary()
    layers = [s["by_block"].get(f"layer {i}", {}).get("launches", 0) for i in range(len(model.layers))]
    paid = payloads(rec.collectives)
    return {
        "start": start, "chunk": chunk,
        "launches_per_chunk": s["launches"], "launches_per_layer": max(layers, default=0),
        "host_syncs": s["host_syncs"], "scratch_bytes": rec.memory.peak + journal, "long_calls": True,
        "collectives": {"per_cycle": s["collectives"], "payloads": paid},
        "collective_bytes": sum(c["count"] * c["bytes"] for c in paid),
        "bytes_per_step": {"total": s["bytes_read"], "written": s["bytes_written"]},
        "flops": {kind: sum(la.flops.get(kind, 0) for la in rec.launches) for kind in ("products", "attention")},
        "launches": [dataclasses.asdict(la) for la in rec.launches],
    }


def float64_sites(entries: list[dict]) -> list[dict]:
    """Float64 launches grouped by (operation, place), with how many of each a cycle makes."""
    groups: dict[tuple, int] = defaultdict(int)
    for e in entries:
        groups[(e["name"], e["block"].partition(" ")[0], tuple(e["where"][-2:]))] += 1
    return [{"op": op, "block": block, "where": list(where), "count": n}
            for (op, block, where), n in sorted(groups.items())]


def payloads(collectives: list[dict]) -> list[dict]:
    """Collectives grouped by (op, payload bytes), with how many of each a cycle makes."""
    groups: dict[tuple, int] = defaultdict(int)
    for c in collectives:
        groups[(c["op"], c["bytes"])] += 1
    return [{"op": op, "bytes": b, "count": n} for (op, b), n in sorted(groups.items())]
