"""Run code on several gloo ranks, each its own process, as `appliance --devices cpu:N` runs them: `launch`
starts a module once per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun sets them) and
waits for all; `call` runs one function of a test module on every rank and returns each rank's result.

    python -m tests.ranks --call tests.test_rank_plans:diverging_follower --world 4 --out DIR [--args JSON]
"""

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def launch(module: str, argv: list[str], out: Path, world: int, timeout: float | None = None) -> list[dict]:
    """Start `world` ranks of `module` with `argv` (whose --out is `out`) on a free port and wait for them:
    each rank's result (out/rank<r>.json). A rank that fails or outlives `timeout` raises with the end of its
    output (out/rank<r>.log: a file, because a rank blocked on a full pipe would stall the others in their
    next collective); the others are killed then."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = []
    for r in range(world):
        with open(out / f"rank{r}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=dict(env, RANK=str(r)), cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        for r, p in enumerate(procs):
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = "a timeout"
            if code != 0:
                raise RuntimeError(f"rank {r} failed ({code}): {(out / f'rank{r}.log').read_text()[-3000:]}")
    finally:  # a failed or hung rank leaves the others waiting in a collective
        for p in procs:
            p.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def call(function: str, out: Path, world: int = 4, timeout: float = 300, **kwargs) -> list:
    """`function` ("module:name", taking the rank's World and `kwargs`) on `world` gloo ranks: each rank's
    return value (JSON)."""
    argv = ["--call", function, "--world", str(world), "--out", str(out), "--args", json.dumps(kwargs)]
    return [r["result"] for r in launch("tests.ranks", argv, out, world, timeout)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", required=True, help="module:function")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--args", default="{}", help="JSON object of keyword arguments")
    args = ap.parse_args()
    import torch.distributed

    from appliance.parallel.world import start

    world = start(f"cpu:{args.world}")
    module, name = args.call.split(":")
    result = getattr(importlib.import_module(module), name)(world, **json.loads(args.args))
    (args.out / f"rank{world.rank}.json").write_text(json.dumps({"rank": world.rank, "result": result}))
    # every rank is done, then all leave at once: a rank still tearing down its store connections when rank 0
    # (the store's host) has gone aborts ("terminate called without an active exception")
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
