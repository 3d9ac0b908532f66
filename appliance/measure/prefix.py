"""What prefix reuse costs (`appliance bench prefix`): taking a checkpoint, committing a conversation to the
cache, rewinding the live state to random positions (the restore, then the prefill of what lies between
the checkpoint and the target), and restoring a whole conversation from host memory and from disk.
Medians over repeats, with the bytes moved; device time where there is a GPU (the copies are synchronized
before the clock stops)."""

import random
import statistics
import time

import torch

from .bench import random_prompt


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e3, out


def measure_prefix(make_session, context: int, rewinds: int = 20, seed: int = 0) -> dict:
    """`make_session()`: a new DecodeSession with the options under test (a prefix cache with a disk tier);
    `context`: the conversation's length in tokens."""
    s = make_session()
    dev = s.device
    ids = random_prompt(s.cfg.vocab_size, context, seed)
    prefill_ms, _ = _timed(lambda: s.prefill_all(ids), dev)
    tl = s.timeline
    n = s.state.length
    ckpt_ms = []
    for _ in range(5):
        tl.ckpts.pop(n, None)
        ms, _ = _timed(tl.checkpoint, dev)
        ckpt_ms.append(ms)
    ckpt_bytes = tl.ckpts[n].nbytes
    commit_ms, _ = _timed(s.finish, dev)
    restore, refill, refill_tokens = [], [], []
    for p in sorted(random.Random(seed).sample(range(1, n), rewinds), reverse=True):  # each from the live state
        ms, landed = _timed(lambda p=p: s.prepare(ids[:p + 1]), dev)
        ms2, _ = _timed(lambda p=p: list(s.prefill(ids[:p])), dev)
        restore.append(ms)
        refill.append(ms2)
        refill_tokens.append(p - landed)
    tiers = {}
    s.reset()
    tiers["host"] = _restore(s, ids, dev)
    tiers["disk"] = _restore(make_session(), ids, dev)
    stride = tl.stride
    return {
        "context": n, "stride": stride, "prefill_ms": prefill_ms, "prefill_ms_per_token": prefill_ms / n,
        "checkpoint": {"bytes": ckpt_bytes, "ms": statistics.median(ckpt_ms)},
        "commit_ms": commit_ms,
        "rewind": {"n": rewinds, "restore_ms": statistics.median(restore),
                   "prefilled_tokens_mean": statistics.mean(refill_tokens),
                   "prefill_ms_median": statistics.median(refill), "total_ms_max": max(map(sum, zip(restore, refill)))},
        "restore": tiers,
    }


def _restore(s, ids, dev) -> dict:
    ms, cached = _timed(lambda: s.prepare(ids), dev)
    last = s.timeline.last
    return {"source": last["source"], "cached_tokens": cached, "bytes": last["restored_bytes"], "ms": ms}
