"""The ideal a counted cycle's bytes are held against (`ideal_bytes`, appliance/measure/count.py): each weight
the cycle touches read once in its stored format (this rank's share of the split ones; embeddings and Engram
tables at the rows gathered; routed experts as counted) plus the decode state the math must read: the window
keys each layer sees, the pooling carry of each compressor, every visible index key of each indexer (a
re-indexing layer only its candidate blocks' keys), the distinct compressed rows each attention selects, in
the format the state stores them.
"""

import functools

import torch

from appliance.model.config import ModelConfig, V41Config

from .shapes import meta_model, rank_shares

_EMBEDDINGS = ("embed.weight", "markov_head.embed.weight", "markov_head.markov_w1.weight", ".gate.tid2eid")


def ideal_bytes(cfg: ModelConfig, world: int, width: int, drafting: bool, routed: int, selected_rows: int,
                state, context: int, draft_state=None) -> dict:
    """What one cycle must read at least (the module docstring), this rank's share; `routed` and
    `selected_rows`: the routed experts' and the selected compressed rows' bytes, as counted. A rank's
    share of each weight is what the split (appliance/parallel/sharding.py) leaves it of a meta build."""
    shares, ckpt = _rank_shares(cfg, world)
    weights = gathered = 0.0
    for name, (_, shape) in ckpt.tensors.items():
        if ".engram.embed." in name or (name.startswith("mtp.") and not drafting):
            continue  # Engram's rows: as gathered (below)
        if ".experts." in name and ".shared_experts." not in name:
            continue  # routed: as counted
        n = ckpt.nbytes(name) * shares[name]
        if name.endswith(_EMBEDDINGS):
            gathered += width * n / shape[0]
        else:
            weights += n
    engram = 0
    if isinstance(cfg, V41Config) and cfg.engram is not None:
        e = cfg.engram
        engram = width * len(e.layer_ids) * (e.max_ngram - 1) * e.n_heads * (e.head_dim + e.head_dim // 32)
    st = state_ideal(cfg, state, context, width) + selected_rows
    if draft_state is not None:
        st += state_ideal(cfg, draft_state, context, width)
    total = int(weights + gathered + routed + engram + st)
    return {"total": total, "weights": int(weights), "embedding_rows": int(gathered), "routed_experts": routed,
            "engram_rows": engram, "state": int(st)}


@functools.lru_cache(maxsize=4)
def _rank_shares(cfg: ModelConfig, world: int):
    """`rank_shares` over `world` ranks and the checkpoint: two meta builds once a process, not a cycle."""
    whole = meta_model(cfg)
    return rank_shares(whole, world), whole.checkpoint


def state_ideal(cfg: ModelConfig, state, context: int, width: int) -> float:
    """Decode-state bytes one cycle of `width` rows after `context` positions must read, as `state` stores
    them, except the compressed rows attention selects (counted where they are selected)."""
    def row(t: torch.Tensor) -> int:
        return t.shape[-1] * t.element_size()

    total = 0.0
    for name, ring in state.rings.items():
        kind, _, idx = name.rpartition(".")
        if kind == "window" or kind.startswith("dspark") or name.startswith("dspark."):
            total += min(context, cfg.window_size) * row(ring.data)
        elif kind in ("compressor", "index_compressor"):
            total += min(context, cfg.compress_ratios[int(idx)]) * row(ring.data)
    for name, cache in state.rows.items():
        if not name.startswith("index_keys."):
            continue
        owner = int(name.rpartition(".")[2])
        visible = (context + width) // cache.ratio
        if isinstance(cfg, V41Config):
            for L in cfg.index_source_layers:
                if cfg.kv_source_of(L) != owner:
                    continue
                keys = visible
                if 0 <= cfg.candidate_source_layer < L:  # re-indexing: only the candidate blocks' keys
                    keys = min(visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                total += keys * row(cache.data)
        else:
            total += visible * row(cache.data)
    if isinstance(cfg, V41Config) and cfg.engram is not None:
        total += width * cfg.engram.max_ngram * state.tokens.element_size()
    return total
