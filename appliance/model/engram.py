"""Engram (DeepSeek-V4.1, layers 1 and 14): hashed n-gram memory added to the residual streams.

Token ids are first mapped to a compressed vocabulary built from tokenizer.json (normalized strings,
dense ids in order of first appearance). For position p the last n compressed ids (n = 2..max_ngram) are
hashed with per-layer multipliers and per-(n, head) primes into rows of an FP8 table; the gathered rows go
through `wkv` to keys (one per residual copy) and a shared value, and a per-copy gate adds the value.
The tables (~100 GB each for the released model) stay memory-mapped in host memory: the ids depend only on
token ids, so a step looks up the 24 rows per position each layer needs before the first layer runs (one
launch for every Engram layer, the rows copied to the device), and each layer reads them from there.
"""

import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import torch

from appliance.errors import ModelLoadError
from kernels.engram import hash_ids

from .blocks import Linear
from .runtime import Runtime

_WS = re.compile(r"[ \t\r\n]+")


def normalize(text: str) -> str:
    """NFKC -> NFD -> drop combining marks -> lowercase -> collapse whitespace runs -> strip (a string
    that is exactly one space survives as one space)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.combining(ch)).lower()
    s = _WS.sub(" ", s)
    if s == " ":
        s = "\ue000"
    return s.strip().replace("\ue000", " ")


def build_token_map(tokenizer_path, expected_size: int | None) -> torch.Tensor:
    """int64 [len(tokenizer)]: compressed id of every token id (checked against `expected_size`)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: Engram needs tokenizer.json to build its token map", field="tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    vocab = {i: s for s, i in json.loads(path.read_text())["model"]["vocab"].items()}
    for added in tok.get_added_tokens_decoder().items():
        vocab.setdefault(added[0], added[1].content)
    n = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.zeros(n, dtype=np.int64)
    for t in range(n):
        text = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = vocab.get(t, text)
        else:
            key = normalize(text) or text
        out[t] = keys.setdefault(key, len(keys))
    if expected_size is not None and len(keys) != expected_size:
        raise ModelLoadError(f"{path}: Engram token map has {len(keys)} distinct keys, the config says "
                             f"engram_compressed_vocab_size={expected_size}", field="engram_compressed_vocab_size",
                             value=len(keys))
    return torch.from_numpy(out)


def multipliers(layer: int, compressed_vocab: int, max_ngram: int) -> list[int]:
    """M[layer][i] = 2 v + 1 with v drawn by numpy's PCG64 seeded 10007 * layer."""
    bound = ((2**63 - 1) // compressed_vocab) // 2
    v = np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram)
    return [int(2 * x + 1) for x in v]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def primes(layer_ids, max_ngram: int, n_heads: int, bucket_base: int) -> dict[int, list[int]]:
    """One prime per (layer, n-gram size, head), the successive primes above bucket_base - 1 in that order."""
    out, p = {}, bucket_base - 1
    for layer in layer_ids:
        out[layer] = []
        for _ in range(2, max_ngram + 1):
            for _ in range(n_heads):
                p += 1
                while not _is_prime(p):
                    p += 1
                out[layer].append(p)
    return out


class EngramHash:
    """Table row ids for every position and Engram layer, from the compressed token history."""

    def __init__(self, token_map: torch.Tensor, cfg):
        e = cfg.engram
        self.token_map = token_map
        self.pad = int(token_map[e.pad_token_id])
        self.max_ngram, self.n_heads = e.max_ngram, e.n_heads
        pr = primes(e.layer_ids, e.max_ngram, e.n_heads, e.bucket_base)
        # per layer (rows in the config's order): multipliers [L, n], each column's prime and table offset
        self.mult = torch.tensor([multipliers(layer, e.compressed_vocab_size, e.max_ngram) for layer in e.layer_ids])
        self.primes = torch.tensor([pr[layer] for layer in e.layer_ids])
        self.offsets = torch.cumsum(torch.cat((torch.zeros(len(e.layer_ids), 1, dtype=torch.long),
                                               self.primes[:, :-1]), dim=1), dim=1)
        for i, (layer, rows) in enumerate(zip(e.layer_ids, e.num_embeddings)):
            total = int(self.offsets[i, -1] + self.primes[i, -1])
            if total != rows:
                raise ModelLoadError(f"{cfg.source}: Engram layer {layer}: the primes give {total} table rows, "
                                     f"engram_num_embeddings says {rows}", field="engram_num_embeddings", value=rows)

    def compressed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_map[tokens.clamp(max=len(self.token_map) - 1)]

    def ids(self, history: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """history: compressed ids of positions [0, start + count) (int64) -> row ids [layers, count, n_cols]."""
        positions = torch.arange(start, start + count)
        taus = torch.stack([torch.where(positions - i >= 0, history[(positions - i).clamp(min=0)], -1)
                            for i in range(self.max_ngram)], dim=-1)
        return hash_ids(taus, self.pad, self.mult.cpu(), self.primes.cpu(), self.offsets.cpu(), self.n_heads)

    def lookup(self, ops, tokens: torch.Tensor, positions: torch.Tensor, layers: list["Engram"]):
        """For `positions` from the raw token history buffer: row ids [layers, T, n_cols] and the rows of
        each layer's table at them (codes [layers, T, n_cols, d], scales [layers, T, n_cols, d / 32]) on the
        positions' device (one launch on the fast path, no host reads: capturable)."""
        return ops.engram_lookup(tokens, positions, self.token_map, self.pad, self.mult, self.primes, self.offsets,
                                 self.n_heads, [e.table for e in layers], [e.table_scale for e in layers])


class Engram:
    """One Engram layer: FP8 table (memory-mapped), `wkv`, and the per-copy gates."""

    HOST_TENSORS = ("table", "table_scale")  # large tables stay in host memory (appliance/parallel/placement.py)

    def __init__(self, rt: Runtime, ckpt, cfg, layer: int, rows: int):
        e = cfg.engram
        prefix = f"layers.{layer}.engram"
        self.rt, self.layer, self.dim, self.hc = rt, layer, cfg.dim, cfg.hc_mult
        self.norm_eps = cfg.norm_eps
        self.table = ckpt.tensor(f"{prefix}.embed.weight", (rows, e.head_dim), (torch.float8_e4m3fn,))
        self.table_scale = ckpt.tensor(f"{prefix}.embed.scale", (rows, e.head_dim // 32), (torch.float8_e8m0fnu,))
        n_cols = (e.max_ngram - 1) * e.n_heads
        self.wkv = Linear.load(rt, ckpt, f"{prefix}.wkv.weight", (cfg.hc_mult + 1) * cfg.dim, n_cols * e.head_dim,
                               cfg.weight_block, cfg.act_block)
        qw = ckpt.tensor(f"{prefix}.q_weight", (cfg.hc_mult, cfg.dim))
        kw = ckpt.tensor(f"{prefix}.k_weight", (cfg.hc_mult, cfg.dim))
        self.omega = None if qw is None or kw is None else (qw.float() * kw.float())
        self.split = None  # over ranks: a decode step's wkv split by outputs (parallel/sharding.py EngramSplit)

    def __call__(self, X: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], by_rows: bool = False
                 ) -> torch.Tensor:
        """X [T, hc, D] -> X + gate * value, from this layer's looked-up rows (codes [T, n_cols, d], scales
        [T, n_cols, d / 32]: `EngramHash.lookup`). `by_rows`: X is this rank's share of a long call's rows,
        which take wkv whole; a decode step's call over ranks takes this rank's rows of it (`split`)."""
        codes, scales = rows
        args = (X, codes, scales, self.wkv.weight, self.wkv.act_block, self.omega, self.norm_eps)
        if self.split is None or by_rows:
            return self.rt.ops.engram(*args)
        return self.rt.ops.engram(*args, split=self.split)
