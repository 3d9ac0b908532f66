"""The symmetric-memory sum over ranks (appliance/parallel/collectives.py `SymmSum`) runs its code without a
GPU: four gloo ranks whose buffers are shared-memory files (`HostMemory`, the stand-in of CUDA's symmetric
memory). It takes every call a configuration makes (a 2048-token prefill chunk's, the largest verify's), in
capacity-sized pieces where a call is larger than its buffers, and gives the all-gather sum's bits; so does a
sum inside its consumer (`into`: the peers' buffers read in place). Nothing but the flags orders the ranks: a
rank that lags its peers by a random delay before its calls still gives every consumer the call's partials
(its kernel waits; no slot is overwritten while a peer reads it); a product that publishes its own partial
(the linear kernel's `publish`) gives the gathered sum's bits too."""

import math
import random
import time

import torch
import torch.distributed

from appliance.loader import default_model_dir
from appliance.model.config import load_config
from appliance.parallel.collectives import GatherSum, SymmSum
from appliance.parallel.sharding import largest_sum, verify_rows
from kernels import bench, linear, rank_sum

from .ranks import call

CHUNK = 2048


def calls(cfg, rows: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a forward's sums over ranks at `rows` rows and the model's whole context (the
    capacity's three terms, parallel/sharding.py `largest_sum`)."""
    scored = cfg.max_context // min(r for r in cfg.compress_ratios if r) + 1
    return {"moe rows": (rows * 2, cfg.dim), "index scores": (rows, scored),
            "output": (rows, cfg.dim)}


def symmetric_sums(world, seed: int) -> dict:
    cfg = load_config(default_model_dir())
    verify = verify_rows(cfg, drafter=True)
    capacity = largest_sum(cfg, verify, cfg.max_context)
    symm = SymmSum(world.size, world.rank, capacity, torch.device("cpu"))
    torch.distributed.barrier()  # every rank has unlinked its file
    left = [p.name for p in symm.buffers.paths + symm.flags.paths if p.exists()]
    gather = GatherSum(world.size)
    g = torch.Generator().manual_seed(seed * 10 + world.rank)
    out = {"capacity": capacity, "left_behind": left, "calls": {}}
    for what, shape in [*((f"chunk {k}", s) for k, s in calls(cfg, CHUNK).items()),
                        *((f"verify {k}", s) for k, s in calls(cfg, verify).items())]:
        t = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1])  # the order of the adds shows
        for round_to in (None, torch.bfloat16):
            a, b = symm(t, round_to=round_to), gather(t, round_to=round_to)
            out["calls"][f"{what} {round_to}"] = {"equal": torch.equal(a, b), "values": t.numel()}
        # inside a consumer (`into`): the peers' buffers read in place, or one part summed in pieces first
        (n, a), (m, b) = symm.into(t, consume), gather.into(t, consume)
        out["calls"][f"{what} inside"] = {"equal": torch.equal(a, b) and torch.equal(a, gather(t)),
                                          "values": t.numel(), "parts": [n, m]}
    out["lagging"] = lagging(world, symm, gather, g, random.Random(seed))
    out["produced"] = produced(symm, gather, g)
    out["gathered"] = gathered(symm, gather, g)
    return out


def gathered(symm: SymmSum, gather: GatherSum, g: torch.Generator) -> list[bool]:
    """A product split by its outputs whose part is larger than a slot (a short prefill chunk's Engram
    columns, `Comm.gather_produced`): its consumer gets every rank's part, as all-gathered, not one sum of
    pieces."""
    same = []
    for n in (symm.capacity + 1, 3 * symm.capacity):
        t = torch.randn(n, generator=g)
        k, parts = symm.gathered_into((n,), lambda to, t=t: t, lambda parts: (len(parts), torch.stack(list(parts))))
        same.append(k == 4 and torch.equal(parts, gather.into(t, torch.stack)))
    return same


def produced(symm: SymmSum, gather: GatherSum, g: torch.Generator) -> list[bool]:
    """A product that publishes its own partial (the attention's output product, RowParallel.into through
    `produced_into`: the linear kernel writes the slot and counts the call in, no publish launch), at 1, 3
    and 6 rows of this rank's random input: its consumer's sum equals the gathered sum of the same product."""
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))  # this rank's weight (bench's generator)
    w = bench.fp8_weight(256, 128, (128, 128))
    same = []
    for rows in (1, 3, 6):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        n, got = symm.produced_into((rows, 256), lambda to, x=x: linear.fast(x, w, 128, torch.float32, publish=to),
                                    consume)
        same.append(n == 4 and torch.equal(got, gather(linear.fast(x, w, 128, torch.float32))))
    return same


def consume(parts: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """A consumer of a sum over ranks (a kernel: published partials are waited for inside it): how many parts
    it was given, their sum in rank order."""
    return len(parts), rank_sum.fast(parts)


def lagging(world, symm: SymmSum, gather: GatherSum, g: torch.Generator, order: random.Random) -> list[bool]:
    """Twelve calls back to back (six times the slots), a random rank sleeping a random while before each of
    its publishes, so peers run ahead into calls it has not published: each consumer's sum, compared
    afterwards with the gathered sum of the same partials. `order`: the calls' shapes and lagging ranks, the
    same on every rank (seeded alike); g: this rank's partials."""
    shapes = [(order.randrange(1, 9), order.choice((64, 4096, 5120))) for _ in range(12)]
    slow = [order.randrange(world.size) for _ in shapes]  # the same on every rank: a shared seed
    ts = [torch.randn(s, generator=g) * torch.logspace(-6, 6, s[-1]) for s in shapes]
    sums = []
    for t, who in zip(ts, slow):
        if who == world.rank:
            time.sleep(random.uniform(0.05, 0.3))
        sums.append(symm.into(t, consume)[1])
    return [torch.equal(s, gather(t)) for s, t in zip(sums, ts)]


def test_the_symmetric_sum_stand_in_takes_a_2048_token_chunk_and_the_largest_verify_with_the_gathered_bits(
        tmp_path):
    ranks = call("tests.test_symmetric_sum:symmetric_sums", tmp_path, timeout=600, seed=random.randrange(1 << 20))
    capacity = ranks[0]["capacity"]
    for rank, r in enumerate(ranks):
        assert r["left_behind"] == [], r["left_behind"]  # the shared files are unlinked once mapped
        assert all(r["lagging"]), f"rank {rank}: a consumer read a lagging peer's slot early: {r['lagging']}"
        assert all(r["produced"]), f"rank {rank}: a product published by its own kernel: {r['produced']}"
        assert all(r["gathered"]), f"rank {rank}: a part past a slot not gathered whole: {r['gathered']}"
        for what, c in r["calls"].items():
            assert c["equal"], f"rank {rank}: {what}: the symmetric sum differs from the gathered one"
        verify = {w: c for w, c in r["calls"].items() if w.startswith("verify")}
        assert max(c["values"] for c in verify.values()) <= capacity  # a decode cycle: one piece each
        assert max(math.ceil(c["values"] / capacity) for c in r["calls"].values()) > 1  # a chunk: pieces
        for what, c in r["calls"].items():  # a consumer reads every rank's partial where it fits, else one sum
            if what.endswith("inside"):
                assert c["parts"] == [4 if c["values"] <= capacity else 1, 4], f"{what}: {c['parts']}"
