"""The model's discrete choices, recorded from outside while inside a context: the compressed rows each
indexer keeps, the Engram row ids, the experts each MoE call routes to (`score --dump`, bench's routing
balancedness, the tests that compare paths or fixtures choice by choice).

The model takes no measurement argument: each context shadows the one method that makes a choice with an
attribute on the instance (or the registry's fused MoE op on the runtime) that also hands the result to a
list, and removes it on the way out, the way count.py's `DeclaredReads` wraps the registry. Nothing changes
in what the model computes or captures; outside the context nothing is left behind.
"""

import dataclasses
from contextlib import ExitStack, contextmanager

import torch


def _also(method, record):
    """`method`, also handing each result to `record`."""

    def call(*args, **kwargs):
        out = method(*args, **kwargs)
        record(out)
        return out

    return call


@contextmanager
def _shadowed(obj, name: str, record):
    """Inside, `obj.name(...)` also hands its result to `record` (an attribute of the instance shadows the
    class's method)."""
    setattr(obj, name, _also(getattr(obj, name), record))
    try:
        yield
    finally:
        delattr(obj, name)


@contextmanager
def index_topk(model):
    """Yields layer -> the compressed rows each query kept [T, k] (-1 = none), one per forward, for every
    layer that selects its own (V4: the indexed layers; V4.1: the index sources); after a split call's
    ranks have gathered their shares."""
    kept: dict[int, list[torch.Tensor]] = {}
    with ExitStack() as stack:
        for layer in model.layers:
            stack.enter_context(_shadowed(layer.attn, "select_rows",
                                          lambda topk, L=layer.attn.layer: kept.setdefault(L, []).append(topk)))
        yield kept


@contextmanager
def engram_ids(model):
    """Yields the Engram row ids [T, layers, n_cols], one per forward (none for a model without Engram, or
    built without a token map)."""
    ids: list[torch.Tensor] = []
    hashing = getattr(model, "engram_hash", None)
    if hashing is None:
        yield ids
        return
    with _shadowed(hashing, "lookup", lambda out: ids.append(out[0].transpose(0, 1))):
        yield ids


@contextmanager
def routed_experts(model):
    """Yields every MoE call's selected experts [T, top_k] on the host, in call order (one forward: layer
    order). The op is the runtime's: every MoE on it is recorded (a drafter's too, if it runs inside); each
    call reads its choice back to the host (a sync: not for timed runs)."""
    experts: list[torch.Tensor] = []
    rt = model.rt
    ops = rt.ops
    rt.ops = dataclasses.replace(ops, ffn=_also(ops.ffn, lambda out: experts.append(out[2].cpu())))
    try:
        yield experts
    finally:
        rt.ops = ops
