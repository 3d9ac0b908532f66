"""The one place that maps a config to its family's model and drafter classes."""

import torch

from .config import ModelConfig, V41Config
from .runtime import Runtime


def build_model(cfg: ModelConfig, ckpt, rt: Runtime, token_map: torch.Tensor | None = None):
    """The backbone of `cfg`'s family. `token_map`: V4.1's Engram token map (None: shape-only builds, whose
    Engram layers exist but cannot run)."""
    if isinstance(cfg, V41Config):
        from .deepseek_v41 import V41Model

        return V41Model(cfg, ckpt, rt, token_map)
    from .deepseek_v4 import V4Model

    return V4Model(cfg, ckpt, rt)


def build_drafter(cfg: ModelConfig, ckpt, rt: Runtime, model):
    """The checkpoint's own drafter: DSpark (V4.1, V4-Flash-0731), MTP (V4-Flash April), or None."""
    if cfg.dspark is not None:
        from .dspark import DSpark
        from .rope import RopeTable, frequencies

        # V4.1's stages read the backbone's plain table in their fused row work; 0731's V4 stages compute
        # cos/sin per call, unrounded (the V4 backbone's plain table rounds them for transformers' numerics)
        rope = model.plain_rope if isinstance(cfg, V41Config) else RopeTable(frequencies(cfg.rope_head_dim,
                                                                                          cfg.rope_theta))
        return DSpark(cfg, ckpt, rt, model.embed, model.head, rope)
    if cfg.n_mtp_layers and not isinstance(cfg, V41Config):
        from .mtp import MTP

        return MTP(cfg, ckpt, rt, model.embed, model.head, model.plain_rope)
    return None
