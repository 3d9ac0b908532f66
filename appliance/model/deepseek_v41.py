"""DeepSeek-V4.1-Flash text model, reference definition.

Oracle: the official reference implementation's outputs on tiny random weights (tests/data/v41-tiny-a,
copied from the shared fixtures). What V4.1 changes against V4 (deepseek_v4.py):
- window attention on every layer; compressors of ratio 2 (no overlap, no position bias) and 1 only on the
  KV-source layers, whose compressed rows the following layers read;
- index keys projected from the compressed latent (`wk`, `k_norm`), owned by the KV sources; indexers on
  the index-source layers; other layers reuse the most recent index source's top-k list;
- two-level selection: the candidate source keeps the best blocks of rows, later re-indexing layers over
  its keys only score inside them;
- staggered mHC: a sub-block's `pre` collapses the *next* sub-block's input (one-hot start, no hc_head);
- Engram on its layers; no hash-routed layers; RMSNorm eps 1e-20; no per-head q re-norm;
- official numerics: FP8 activation quantization in blocks of 32 before FP8/FP4 GEMMs, window KV
  fake-quantized to FP8 (all dims), compressed rows to FP4 with e4m3 scales, index q/k to FP4.

One forward call processes T consecutive tokens with exactly the semantics of T single-token steps:
each query sees its own window, its own visible compressed rows and its own top-k.
"""

import torch

from kernels.linear import Product
from kernels.moe import Pending

from .blocks import AttentionProjections, Dense, HyperSite, Linear, MoE, RMSNorm
from .compressor import Compressor
from .config import V41Config
from .engram import Engram, EngramHash
from .rope import RopeTable, frequencies
from .rowsplit import ALL_ROWS, SPLIT_ROWS, gather_rows, query_share
from .runtime import Runtime
from .state import DecodeState, new_state
from .step import Output, Step, begin, capture_column, finish
from .weights import Checkpoint


class V41Attention(AttentionProjections):
    def __init__(self, rt: Runtime, cfg: V41Config, ckpt: Checkpoint, layer: int, rope: RopeTable):
        p = f"layers.{layer}.attn"
        c = cfg
        self.rt, self.cfg, self.layer, self.rope = rt, cfg, layer, rope
        self.ratio = c.compress_ratios[layer]
        self.kv_source = c.kv_source_of(layer)
        self.index_source = c.index_source_of(layer)
        super().__init__(rt, c, ckpt, p)
        self.index_comm = None  # split over ranks: the ranks share a long call's queries (`select_rows`)
        blk, ab = c.weight_block, c.act_block
        self.compressor = None
        if self.kv_source == layer:
            gate = Dense.load(rt, ckpt, f"{p}.compressor.wgate.weight", c.head_dim, c.dim) if self.ratio > 1 else None
            self.compressor = Compressor(
                rt, Dense.load(rt, ckpt, f"{p}.compressor.wkv.weight", c.head_dim, c.dim), gate, None,
                RMSNorm.load(rt, ckpt, f"{p}.compressor.norm.weight", c.head_dim, c.norm_eps),
                self.ratio, overlap=False, width=c.head_dim)
            self.wk = Dense.load(rt, ckpt, f"{p}.indexer.wk.weight", c.index_head_dim, c.head_dim)
            self.k_norm = RMSNorm.load(rt, ckpt, f"{p}.indexer.k_norm.weight", c.index_head_dim, c.norm_eps)
        if self.index_source == layer:
            self.iq = Linear.load(rt, ckpt, f"{p}.indexer.wq_b.weight", c.index_n_heads * c.index_head_dim,
                                  c.q_lora_rank, blk, ab)
            self.weights_proj = Dense.load(rt, ckpt, f"{p}.indexer.weights_proj.weight", c.index_n_heads, c.dim)

    # --- state ---------------------------------------------------------------------------------------

    def init_state(self, state: DecodeState, spare: int) -> None:
        c, L, dt = self.cfg, self.layer, self.rt.dtype
        state.ring(f"window.{L}", c.window_size + spare, c.head_dim, dt)
        if self.compressor is not None:
            self.compressor.ring(state, f"compressor.{L}", spare)
            state.row_cache(f"kv.{L}", self.ratio, c.head_dim, dt)
            state.row_cache(f"index_keys.{L}", self.ratio, c.index_head_dim, dt)

    # --- forward -------------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D] -> the grouped output projection u [T, G r] (the block's `out.expand_pre` finishes it).

        On the fast path three launches before the indexer and one after: the products of x (queries' LoRA,
        window key, compressor, index head weights), the products of q_norm(c_q) (queries, index queries) with
        the row work (RoPE, norms, fake quantization, ring writes), the compressor; the attention."""
        c, L, ops, dt = self.cfg, self.layer, self.rt.ops, self.rt.dtype
        T = x.shape[0]
        official = self.rt.num.official
        index = self.index_source == L
        gate = self.compressor is not None and self.compressor.wgate is not None
        products = [Product(self.wq_a.weight, self.wq_a.act_block, dt),
                    Product(self.wkv.weight, self.wkv.act_block, dt)]
        if self.compressor is not None:
            products.append(Product(self.compressor.wkv.weight, None, torch.float32))
            if gate:
                products.append(Product(self.compressor.wgate.weight, None, torch.float32))
        if index:
            products.append(Product(self.weights_proj.weight, None, dt))
        ys = ops.linear_multi(x, products)
        qs = [Product(self.wq_b.weight, self.wq_b.act_block, dt)]
        if index:
            qs.append(Product(self.iq.weight, self.iq.act_block, dt))
        state, positions = step.state, step.positions
        ring = state.rings[f"window.{L}"]
        # a call of at most `spare` positions writes the ring before attending: the slots it overwrites hold
        # positions no query of the call reads (state.py); a longer one (prefill) writes after attending
        now = T <= state.spare
        if now:
            ring.record(positions)
        scale = c.index_head_dim**-0.5 * c.index_n_heads**-0.5
        q, k, qi, w = ops.query_inputs(ys[0], qs, (self.q_norm.weight, self.q_norm.eps), ys[1], positions,
                                       self.rope.tables, self.kv_norm.weight, self.kv_norm.eps, ring.data, now,
                                       official, c.index_n_heads if index else 0, ys[-1] if index else None, scale)
        if self.compressor is not None:
            self._compress(ys[2], ys[3] if gate else None, step, now)
        if self.ratio == 0:
            topk, comp_kv = None, None
        else:
            topk = self.select_rows(qi, w, step) if index else step.topk[self.index_source]
            comp_kv = step.state.rows[f"kv.{self.kv_source}"].visible(step.bound)
        o = ops.attend(q, ring.data, k, positions, c.window_size, comp_kv, topk, self.sink, c.head_dim**-0.5,
                       self.p_dtype, self.rope.tables)
        if not now:
            ring.write(positions, k)
        return self.out.project(o)

    def _compress(self, kappa: torch.Tensor, zeta: torch.Tensor | None, step: Step, now: bool) -> None:
        """KV source: pool completed groups, write their compressed rows and index keys (and the ring)."""
        L, state, positions = self.layer, step.state, step.positions
        ring = state.rings[f"compressor.{L}"]
        kv_rows, keys = state.rows[f"kv.{L}"], state.rows[f"index_keys.{L}"]
        if state.journal.recording:
            row = positions // self.ratio
            index = torch.where((positions + 1) % self.ratio == 0, row, torch.full_like(row, kv_rows.trash))
            if now:
                ring.record(positions)
            keys.record(index, positions)
            kv_rows.record(index, positions)
        comp = self.compressor
        self.rt.ops.compress(kappa, zeta, positions, ring.data, self.ratio, comp.norm.weight, comp.norm.eps,
                             self.wk.weight, self.k_norm.weight, self.rope.tables, kv_rows.data, keys.data, now,
                             self.rt.num.official, self.rt.dtype)
        if not now:
            ring.write(positions, torch.cat((kappa, torch.zeros_like(kappa) if zeta is None else zeta), dim=-1))

    def _keys_owner(self, step: Step) -> int:
        """Whose index keys this indexer scores. `own`: its KV source's. `reference`: on single-token
        decode calls the released code scores a non-emitting owner against the cache published last (the
        last KV source, in layer order, that emitted on this step before it, or on the previous step)."""
        c, L = self.cfg, self.layer
        if step.index_keys == "own" or not step.decode_call:
            return self.kv_source
        p = step.start
        if self.kv_source == L and (p + 1) % self.ratio == 0:
            return L

        def emits(s, pos):
            return (pos + 1) % c.compress_ratios[s] == 0

        earlier = [s for s in c.kv_source_layers if s < L and emits(s, p)]
        if earlier:
            return earlier[-1]
        previous = [s for s in c.kv_source_layers if emits(s, p - 1)]
        return previous[-1] if previous else self.kv_source

    def select_rows(self, qi: torch.Tensor, w: torch.Tensor, step: Step) -> torch.Tensor:
        """The compressed rows each query reads: the top-k of its index scores (qi [T, heads, dI] and the
        head weights w [T, heads] as attn_inputs made them). Split over ranks (`index_comm`), a call of more
        rows than a verify block scores and selects this rank's share of the queries and gathers the
        selections: a query's scores do not depend on the other rows, so they are one device's."""
        c, L, ops, dt = self.cfg, self.layer, self.rt.ops, self.rt.dtype
        keys = step.state.rows[f"index_keys.{self._keys_owner(step)}"].visible(step.bound)
        official = self.rt.num.official
        rows = query_share(self.index_comm, qi.shape[0])
        positions = step.positions[rows]
        source = L == c.candidate_source_layer
        inside = step.candidates[rows] if 0 <= c.candidate_source_layer < L else None  # level two
        block, narrowed = c.candidate_block_size, False
        if inside is None and qi.shape[0] > SPLIT_ROWS:  # the call's rows: every rank takes the same branch
            inside = blocks_by_maxima(ops, qi[rows], w[rows], keys, positions, self.ratio, dt if official else None,
                                      block, c.index_topk, c.candidate_topk_blocks if source else 0)
            narrowed = inside is not None  # at the source: its candidate blocks, chosen
        scores = ops.index_scores(qi[rows], w[rows], keys, positions, self.ratio, dt if official else None,
                                  inside=inside, block=block)
        topk, made = ops.index_select(scores, c.index_topk, positions, self.ratio, block=block,
                                      top_blocks=c.candidate_topk_blocks if source and not narrowed else 0,
                                      inside=inside)
        made = inside if source and narrowed else made
        topk = topk[:, : min(c.index_topk, keys.shape[0])]  # inside the blocks: k wide, as if over all N rows
        if rows != ALL_ROWS:
            topk = gather_rows(self.index_comm, topk, qi.shape[0])
            made = gather_rows(self.index_comm, made, qi.shape[0]) if made is not None else None
        if source:
            step.candidates = made
        step.topk[L] = topk
        return topk


# a long call selects by block maxima where its keys outnumber the rows it then scores this many times: below,
# the second launch and the rows scored again cost more than the scores' writes and passes they save
MAXIMA_GAIN = 4


def blocks_by_maxima(ops, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, ratio: int,
                     round_dtype: torch.dtype | None, block: int, k: int, top_blocks: int) -> torch.Tensor | None:
    """A long call over many keys (a prefill chunk deep in a prompt) selects as a re-indexing layer does:
    blocks of `block` rows chosen by their largest score (the scores kernel stores only those), then only
    their rows scored -> the blocks the rows are selected inside (where `top_blocks`, the source: its
    candidate blocks), or None where the keys are too few to gain. The same picks as over all rows: the
    k-th largest score is at least the k-th largest block maximum, so every row above it, and every tie of
    it a lower index would pick, lies in the k blocks with the largest maxima (ties to the lower block), or
    in the source's candidate blocks (more than k: the newest, kept whatever its score, may displace one)."""
    wanted = top_blocks or k
    few = keys.shape[0] <= MAXIMA_GAIN * wanted * block
    if few or (top_blocks and top_blocks <= k) or block & (block - 1) or block > 32:
        return None
    maxima = ops.index_scores(qi, w, keys, positions, ratio, round_dtype, maxima=block)
    if not top_blocks:
        return ops.index_select(maxima, k)[0]
    # the maxima's valid blocks, as positions of ratio 1: a query with n valid rows has ceil(n / block)
    blocks = -(-((positions + 1) // ratio) // block)
    return ops.index_select(maxima, 0, blocks - 1, 1, block=1, top_blocks=top_blocks)[1]


class StaggeredBlock:
    """A V4.1 block: Engram (if any), then attention and MoE between staggered mHC sites."""

    def __init__(self, rt: Runtime, cfg, ckpt: Checkpoint, prefix: str, attn, ffn: MoE,
                 engram: Engram | None = None, captured: tuple[int, int] | None = None):
        """`captured`: this layer's place among DSpark's target layers and their count (step.capture_column;
        None: it is not one)."""
        c = cfg
        self.rt, self.attn, self.ffn, self.engram, self.captured = rt, attn, ffn, engram, captured
        self.attn_norm = RMSNorm.load(rt, ckpt, f"{prefix}.attn_norm.weight", c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm.load(rt, ckpt, f"{prefix}.ffn_norm.weight", c.dim, c.norm_eps)
        self.hc_attn = HyperSite(rt, ckpt, f"{prefix}.hc_attn", c.hc_mult, c.dim, c.norm_eps, c.hc_eps,
                                 c.hc_sinkhorn_iters)
        self.hc_ffn = HyperSite(rt, ckpt, f"{prefix}.hc_ffn", c.hc_mult, c.dim, c.norm_eps, c.hc_eps,
                                c.hc_sinkhorn_iters)

    def __call__(self, X, pre: torch.Tensor, step, engram_rows=None, fuse: bool = False):
        """X [T, hc, D] entering the layer (before Engram, whose looked-up rows are `engram_rows`), or the
        previous layer's MoE output still to combine (kernels.moe.Pending: this layer's attention site
        combines and expands it in its launch), `pre` the collapse weights the previous sub-block produced ->
        (X, pre for the next layer); `fuse`: leave this layer's MoE output uncombined for the next layer's site
        (where the next is not an Engram layer: Engram reads the streams first). A long call split over ranks
        holds its share of the rows (`step.share`: the mHC sites and Engram work those only) and gathers each
        sub-block's input; the sums over ranks return the share's rows."""
        if self.engram is not None:
            X = self.engram(X, engram_rows, step.split)
        # DSpark reads the stream entering a captured layer, averaged over the copies (the site writes it into
        # the step's `hidden`)
        if isinstance(X, torch.Tensor):
            mean = step.capture(X, self.captured) if self.captured else False
            xa, a_pre, a_post, a_comb, _ = self.hc_attn.pre(X, pre, self.attn_norm, mean)
        else:
            mean = step.capture(X[1], self.captured) if self.captured else False
            X, xa, a_pre, a_post, a_comb, _ = self.hc_attn.expand_pre(*X, pre, self.attn_norm, mean)
        X, xf, f_pre, f_post, f_comb = self.attn.out.expand_pre(self.attn(step.gather(xa), step), X, a_post, a_comb,
                                                                 self.hc_ffn, a_pre, self.ffn_norm)
        X = self.ffn.expand(step.gather(xf), X, f_post, f_comb, pending=fuse)
        return X, f_pre


def final_collapse(ops, X, pre: torch.Tensor, rows: slice, norm: RMSNorm, collapsed: torch.Tensor | None = None):
    """norm(the streams' rows `rows` collapsed by the last layer's `pre`), one launch: the streams X, or the
    last layer's MoE not yet combined (`Pending`: combined and expanded in the collapse's launch);
    `collapsed`: where the collapse also goes (kernels/mhc.py `pre`)."""
    site = (None, None, None, 0.0, 0.0, 0, norm.weight, norm.eps)  # no site: the collapse by `pre`, normed
    if isinstance(X, Pending):
        return ops.hc_expand_pre(*X.rows(rows), pre[rows], *site, collapsed=collapsed)[1]
    return ops.hc_pre(X[rows], pre[rows], *site, collapsed=collapsed)[0]


def moe_for(rt: Runtime, cfg: V41Config, ckpt: Checkpoint, prefix: str, n_experts: int, top_k: int) -> MoE:
    return MoE(rt, ckpt, prefix, cfg.dim, cfg.moe_inter_dim, n_experts, top_k, cfg.score_func, cfg.route_scale,
               cfg.swiglu_limit, cfg.weight_block, cfg.act_block, route_eps=1e-20,
               n_shared=cfg.n_shared_experts)


class V41Model:
    family = "deepseek_v41"

    def __init__(self, cfg: V41Config, ckpt: Checkpoint, rt: Runtime, token_map: torch.Tensor | None):
        c = cfg
        self.cfg, self.rt = cfg, rt
        self.row_comm = None  # split over ranks on the fast path: a long call's streams are held by rows (Step)
        self.embed = ckpt.tensor("embed.weight", (c.vocab_size, c.dim))
        self.head = Dense.load(rt, ckpt, "head.weight", c.vocab_size, c.dim)
        self.norm = RMSNorm.load(rt, ckpt, "norm.weight", c.dim, c.norm_eps)
        self.plain_rope = plain = RopeTable(frequencies(c.rope_head_dim, c.rope_theta))  # DSpark's too
        compressed = RopeTable(frequencies(c.rope_head_dim, c.compress_rope_theta, c.rope_factor,
                                           c.original_seq_len, c.beta_fast, c.beta_slow))
        self.engram_hash = None
        engrams = {}
        if c.engram is not None:
            # without a token map (shape-only builds) the Engram layers exist but cannot run
            self.engram_hash = None if token_map is None else EngramHash(token_map, c)
            for layer, rows in zip(c.engram.layer_ids, c.engram.num_embeddings):
                engrams[layer] = Engram(rt, ckpt, c, layer, rows)
        self.layers = []
        for L in range(c.n_layers):
            attn = V41Attention(rt, c, ckpt, L, compressed if c.compress_ratios[L] else plain)
            ffn = moe_for(rt, c, ckpt, f"layers.{L}.ffn", c.n_routed_experts, c.n_activated_experts)
            self.layers.append(StaggeredBlock(rt, c, ckpt, f"layers.{L}", attn, ffn, engrams.get(L),
                                              capture_column(c.dspark, L)))

    def new_state(self, capacity: int, spare: int = 16, device=None) -> DecodeState:
        """The decode state for `capacity` positions (`device`: the model's by default; "meta" sizes it
        without allocating); the RoPE tables grow to cover it."""
        device = device or self.rt.device
        if torch.device(device) == torch.device(self.rt.device):  # not a sizing-only state of another device
            for rope in self.ropes:
                rope.ensure(capacity, device)
        return new_state(capacity, spare, device, [layer.attn for layer in self.layers], self.cfg.hc_mult)

    @property
    def ropes(self) -> list:
        """The distinct RoPE tables of the layers (layers of one kind share theirs) and DSpark's (the plain one)."""
        ropes = [self.plain_rope] + [layer.attn.rope for layer in self.layers]
        return list({id(rope): rope for rope in ropes}.values())

    def embed_tokens(self, step: Step):
        """The step's tokens into the history; X [n, hc, D] (hc identical copies of the embedding rows of its
        share) and the one-hot first collapse: one launch (ops.token_inputs)."""
        state, c = step.state, self.cfg
        X = self.rt.ops.token_inputs(step.tokens, step.positions, state.tokens, self.embed, c.hc_mult, self.rt.dtype,
                                     step.share)
        return X, state.first_collapse(X.shape[0], c.hc_mult)

    def engram_rows(self, step: Step) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each Engram layer's looked-up rows for the step's positions (codes, scales), by layer."""
        if self.engram_hash is None:
            return {}
        layer_ids = self.cfg.engram.layer_ids
        _, codes, scales = self.engram_hash.lookup(self.rt.ops, step.state.tokens, step.positions[step.share],
                                                   [self.layers[L].engram for L in layer_ids])
        return dict(zip(layer_ids, zip(codes, scales)))

    def run_layers(self, X, pre, step: Step, first: int, last: int, engram_rows: dict, fuse_last: bool = False):
        """Layers first .. last - 1; `fuse_last`: the last one's MoE left for the final collapse's launch."""
        for L in range(first, last):
            # its MoE combined by the next site (not an Engram layer's: Engram reads the streams first)
            fuse = self.layers[L + 1].engram is None if L + 1 < last else fuse_last
            X, pre = self.layers[L](X, pre, step, engram_rows.get(L), fuse)
        return X, pre

    def final(self, X, pre, rows: slice = slice(None), step: Step | None = None, sampled: str = ""):
        """The logits of the call's `rows` from the final streams (`step`'s share of the rows where split);
        `sampled`: they go only to samplers' kernels, which read them then (the head's, blocks.Dense)."""
        split = step is not None and step.split
        z = final_collapse(self.rt.ops, X, pre, slice(None) if split else rows, self.norm)
        # the head takes z as it is: a bfloat16 row is its own float32 value (no cast launch, one MMA part)
        return self.head(step.gather(z)[rows] if split else z, torch.float32, sampled)

    def forward(self, tokens: torch.Tensor, state: DecodeState, logits: str = "all", index_keys: str = "own",
                keep_streams: bool = False, start: torch.Tensor | None = None, bound: int | None = None,
                sampled: str = "") -> Output:
        """Process `tokens` at positions state.length.. (or `start`.., a device scalar, with no position
        past `bound`) into the state; `sampled`: the logits go only to samplers' kernels (`final`)."""
        step = begin(state, tokens, start, index_keys, bound, self.row_comm)
        X, pre = self.embed_tokens(step)
        X, pre = self.run_layers(X, pre, step, 0, self.cfg.n_layers, self.engram_rows(step), not keep_streams)
        out = self.final(X, pre, slice(-1, None) if logits == "last" else slice(None), step, sampled)
        finish(step)
        return Output(out, step, step.gather(X) if keep_streams else None)
