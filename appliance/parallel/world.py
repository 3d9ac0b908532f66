"""One model over several devices: one process per device (a rank), torch.distributed between them.

`--devices 0,1,2,3` runs four ranks on four GPUs (NCCL); `--devices cpu:4` four ranks on the CPU (gloo,
for tests). The process the user started is rank 0: it starts ranks 1..n-1 as copies of itself (the same
command line, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), unless torchrun's variables already
say which rank it is. Every rank loads the model, keeps its shard (appliance/sharding.py) and runs the same
code in lockstep; rank 0 alone talks to the user, and broadcasts what the others cannot know (a request
that came over the network, a cancel, a random seed).

A rank that dies takes the group down, never hangs it: rank 0 watches its children and exits non-zero
naming the rank; a child whose parent is gone exits; collectives time out after `TIMEOUT`.
"""

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

TIMEOUT = datetime.timedelta(seconds=20)
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"
    children: list = field(default_factory=list)  # rank 0 when it started the others: [(rank, Popen)]
    stopping: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def broadcast(self, obj=None):
        """rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def comm(self):
        from .sharding import Comm

        return Comm(self.rank, self.size)

    def stop(self) -> None:
        """Rank 0 is done: let the children finish and reap them."""
        self.stopping = True
        for _, proc in self.children:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def parse_devices(devices: str) -> list[str]:
    """--devices -> one device per rank: "cpu", "cpu:4", "cuda", "cuda:1", "0,1,2,3"."""
    d = devices.strip()
    if d.startswith("cpu"):
        n = int(d.split(":")[1]) if ":" in d else 1
        if n < 1:
            raise ValueError(f"--devices {devices}: need at least one rank")
        return ["cpu"] * n
    if d == "cuda":
        return ["cuda:0"]
    if d.startswith("cuda:"):
        return [d]
    try:
        return [f"cuda:{int(x)}" for x in d.split(",")]
    except ValueError:
        raise ValueError(f"--devices {devices}: use cpu, cpu:N, cuda, cuda:N or a list of GPU indices "
                         f"like 0,1,2,3") from None


_WORLD: World | None = None


def start(devices: str) -> World:
    """Join (or start) the process group for --devices; a single device needs no group."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    specs = parse_devices(devices)
    env_rank = os.environ.get("RANK")
    if len(specs) == 1 and env_rank is None:
        _WORLD = World(0, 1, specs[0])
        return _WORLD
    if env_rank is None:  # rank 0 of a group it starts itself
        os.environ.update(RANK="0", WORLD_SIZE=str(len(specs)), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        world = World(0, len(specs), specs[0])
        world.children = [(r, _spawn(r)) for r in range(1, len(specs))]
        threading.Thread(target=_watch_children, args=(world,), daemon=True, name="rank-watch").start()
    else:
        rank, size = int(env_rank), int(os.environ["WORLD_SIZE"])
        if size != len(specs):
            raise ValueError(f"--devices {devices} names {len(specs)} devices but WORLD_SIZE is {size}")
        world = World(rank, size, specs[rank])
        if os.environ.get("APPLIANCE_PARENT"):
            threading.Thread(target=_watch_parent, args=(world,), daemon=True, name="parent-watch").start()
    backend = "nccl" if world.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(world.device))
    torch.distributed.init_process_group(backend, rank=world.rank, world_size=world.size, timeout=TIMEOUT)
    _WORLD = world
    return world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(rank: int) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), APPLIANCE_PARENT=str(os.getpid()))
    # the same command line; only rank 0 writes to stdout
    proc = subprocess.Popen([sys.executable, "-m", "appliance", *sys.argv[1:]], env=env, stdout=subprocess.DEVNULL)
    print(f"appliance: started rank {rank} (pid {proc.pid})", file=sys.stderr, flush=True)
    return proc


def _die(message: str) -> None:
    print(f"appliance: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def _watch_children(world: World) -> None:
    while True:
        for rank, proc in world.children:
            code = proc.poll()
            if code is not None and (code != 0 or not world.stopping):
                for _, other in world.children:
                    if other.poll() is None:
                        other.kill()
                _die(f"rank {rank} (pid {proc.pid}) exited with code {code}; stopping all ranks")
        time.sleep(0.2)


def _watch_parent(world: World) -> None:
    parent = int(os.environ["APPLIANCE_PARENT"])
    while True:
        if os.getppid() != parent:
            _die(f"rank 0 (pid {parent}) is gone; rank {world.rank} stops")
        time.sleep(0.2)


class Cancel:
    """A cancel flag every rank reads identically: rank 0's, broadcast at each check."""

    def __init__(self, world: World, local=None):
        self.world, self.local = world, local

    def is_set(self) -> bool:
        flag = bool(self.local is not None and self.local.is_set()) if self.world.main else None
        return bool(self.world.broadcast(flag))

    def set(self) -> None:
        if self.local is not None:
            self.local.set()
