"""One model over several devices: one process per device (a rank), torch.distributed between them.

`--devices 0,1,2,3` runs four ranks on four GPUs (NCCL); `--devices cpu:4` four ranks on the CPU (gloo,
for tests). The process the user started is rank 0: it starts ranks 1..n-1 as copies of itself (the same
command line, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set), unless torchrun's variables already
say which rank it is. Every rank loads the model, keeps its shard (appliance/parallel/sharding.py) and runs the same
code in lockstep; rank 0 alone talks to the user and decides (appliance/decode/plan.py): it publishes each
job, and broadcasts the decisions taken inside one (go on or stop, an adaptive draft's length).

Between requests the followers wait without any timeout: rank 0 publishes each request in the group's
store (`publish`) and the followers block on the next key (`next_job`), however long the user pauses; a
collective's `TIMEOUT` applies only inside a request. A rank that dies or hangs takes the group down, never
hangs it: every rank bumps a heartbeat counter in the store every `BEAT_S` and watches its peers' (rank 0
watches all, the others watch rank 0); one that stops for `DEAD_AFTER_S` ends the service with a message
naming it. Rank 0 also watches the processes it started, and a child whose parent is gone exits.
"""

import atexit
import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from .collectives import CallCheck, all_gather, make_sum

# One collective, inside a request: a rank gone quiet that long fails the request. APPLIANCE_COLLECTIVE_TIMEOUT_S
# sets it (tests shorten it to show that a follower waiting for the next request outwaits it).
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("APPLIANCE_COLLECTIVE_TIMEOUT_S", "20")))
STARTUP = datetime.timedelta(seconds=300)  # the ranks meeting: processes start and import torch first
BEAT_S = 0.5  # every rank bumps its heartbeat this often
# A peer whose heartbeat has not moved for this long is hung. Long enough that a rank starved of CPU is not
# taken for one (3 s once ended a working four-rank run on two cores shared by ten busy processes); a rank
# that dies is found sooner: by the process watch (rank 0's children, a follower's parent: 0.2 s), or inside
# a request by the collective its closed connection fails.
DEAD_AFTER_S = 10.0
EXIT_WAIT_S = 15.0  # at a normal exit, the longest wait for the watcher threads to leave their store calls
FOREVER = datetime.timedelta(days=3650)  # how long a follower waits for the next request


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"
    children: list = field(default_factory=list)  # rank 0 when it started the others: [(rank, Popen)]
    stopping: bool = False
    store_address: tuple[str, int] | None = None  # the group's key-value store (requests, heartbeats)
    jobs: int = 0  # requests published (rank 0) or taken (the others) so far
    quit: threading.Event = field(default_factory=threading.Event)  # set at exit: the watcher threads end
    check: object = None  # --check-ranks: a collectives.CallCheck every collective calls first
    _job_store: object = None

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
        if self.check is not None:
            self.check("broadcast")
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, device=self._device())
        return box[0]

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many ints on every rank), on every rank."""
        mine = torch.tensor(values, dtype=torch.long, device=self._device())
        if self.check is not None:
            self.check("gather", mine)
        every = torch.empty(self.size * len(values), dtype=torch.long, device=mine.device)
        all_gather(every, mine)
        return every.view(self.size, len(values)).tolist()

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, on every rank (rare paths: naming what differs)."""
        every = [None] * self.size
        torch.distributed.all_gather_object(every, obj)
        return every

    def check_calls(self) -> None:
        """--check-ranks: from now on every collective first compares its call across ranks (a collective
        call: every rank makes it)."""
        self.check = CallCheck(self.size, self._device())

    def _device(self) -> torch.device:
        return torch.device(self.device)

    def publish(self, obj) -> None:
        """Rank 0: hand `obj` (a request, or None to stop) to the followers' `next_job`."""
        if not self.distributed:
            return
        store = self._jobs()
        store.set(f"job/{self.jobs}", pickle.dumps(obj))
        if self.jobs >= 2:  # every follower took job n-2 before job n-1 could run its collectives
            store.delete_key(f"job/{self.jobs - 2}")
        self.jobs += 1

    def next_job(self):
        """A follower: block, without a timeout, until rank 0 publishes the next job; return it."""
        obj = pickle.loads(self._jobs().get(f"job/{self.jobs}"))
        self.jobs += 1
        return obj

    def _jobs(self):
        if self._job_store is None:  # its own connection: its `get` may block for as long as the user pauses
            self._job_store = self.client(FOREVER)
        return self._job_store

    def client(self, timeout: datetime.timedelta = TIMEOUT):
        """A new connection to the group's store (a blocking call on one must not hold up another's)."""
        host, port = self.store_address
        return torch.distributed.TCPStore(host, port, self.size, False, timeout=timeout, wait_for_workers=False)

    def finished(self, store, rank: int) -> bool:
        """Whether `rank` ended normally (it says so in the store as it exits; a killed rank cannot)."""
        return store.check([f"done/{rank}"])

    def comm(self, allreduce: str = "auto", capacity: int = 1 << 20):
        """The collectives of this group (a collective call: every rank makes it); `capacity`: the values a
        symmetric-memory sum takes in one piece (each of its two exchanges: sharding.Comm `later`)."""
        from .sharding import Comm

        sum = make_sum(allreduce, self.size, self.rank, self._device(), capacity, check=self.check)
        later = make_sum(allreduce, self.size, self.rank, self._device(), capacity, check=self.check)
        return Comm(self.rank, self.size, sum, check=self.check, later=later)

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


def check_cuda(devices: str, specs: list[str]) -> None:
    """Refuse, in one line, GPUs this machine does not have (before any rank starts: a rank that finds no
    CUDA fails deep inside torch, and every rank would print its own traceback)."""
    wanted = [int(s.split(":")[1]) for s in specs if s.startswith("cuda:")]
    if not wanted:
        return
    if not torch.cuda.is_available():
        ranks = f", or cpu:{len(specs)} for {len(specs)} ranks on the CPU" if len(specs) > 1 else ""
        raise ValueError(f"--devices {devices}: this machine has no CUDA device (torch {torch.__version__}); use "
                         f"--devices cpu{ranks}")
    count = torch.cuda.device_count()
    if max(wanted) >= count:
        raise ValueError(f"--devices {devices}: GPU {max(wanted)} does not exist; this machine has {count} "
                         f"(0..{count - 1})")


_WORLD: World | None = None


def start(devices: str) -> World:
    """Join (or start) the process group for --devices; a single device needs no group."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    specs = parse_devices(devices)
    check_cuda(devices, specs)
    env_rank = os.environ.get("RANK")
    if len(specs) == 1 and env_rank is None:
        _WORLD = World(0, 1, specs[0])
        return _WORLD
    if env_rank is None:  # rank 0 of a group it starts itself
        os.environ.update(RANK="0", WORLD_SIZE=str(len(specs)), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        world = World(0, len(specs), specs[0])
        world.children = [(r, _spawn(r)) for r in range(1, len(specs))]
        watch = threading.Thread(target=_watch_children, args=(world,), daemon=True, name="rank-watch")
        watch.start()  # now: a child that dies while the group forms must be named too
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
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosts_store = world.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = torch.distributed.TCPStore(host, port, world.size, hosts_store, timeout=STARTUP)
    world.store_address = (host, port)
    torch.distributed.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                         timeout=TIMEOUT)
    beat = threading.Thread(target=_heartbeat, args=(world,), daemon=True, name="heartbeat")
    beat.start()
    watchers = [beat] + [t for t in threading.enumerate() if t.name == "rank-watch"]
    atexit.register(_exit_normally, world, store, watchers)
    _WORLD = world
    return world


def _exit_normally(world: World, store, watchers: list[threading.Thread]) -> None:
    """At a normal exit (os._exit, a failure, skips this): say so in the store, so the peers do not take
    the silence for a death, end the watcher threads and destroy the process group before the interpreter
    goes (a thread still inside a store call, or the backend's own threads left to the interpreter's
    teardown, abort the process: "terminate called without an active exception", exit code -6)."""
    store.set(f"done/{world.rank}", "1")
    world.quit.set()
    # a store call on a loaded box (four ranks on two cores) can take seconds: a second's wait once let a
    # heartbeat still inside one abort a follower at exit
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in watchers:
        t.join(timeout=max(deadline - time.monotonic(), 0))
    if torch.distributed.is_initialized():  # its work is done: the command's last collective has returned
        torch.distributed.destroy_process_group()


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
    store = None  # connected when first needed: the watch starts before the group's store exists
    while not world.quit.is_set():
        for rank, proc in world.children:
            code = proc.poll()
            if code is None or (code == 0 and world.stopping):
                continue
            if code == 0 and world.store_address is not None:
                store = store or world.client()
                if world.finished(store, rank):  # it ended its part of the command before rank 0
                    continue
            for _, other in world.children:
                if other.poll() is None:
                    other.kill()
            _die(f"rank {rank} (pid {proc.pid}) exited with code {code}; stopping all ranks")
        world.quit.wait(0.2)


def _heartbeat(world: World) -> None:
    """Bump this rank's counter every BEAT_S and end the service when a watched peer's stops moving (rank 0
    watches every rank, the others rank 0): a dead or hung rank is named within DEAD_AFTER_S."""
    store = world.client()
    peers = [r for r in range(world.size) if r != world.rank] if world.main else [0]
    seen = {r: (-1, time.monotonic()) for r in peers}
    while not world.quit.is_set():
        store.add(f"beat/{world.rank}", 1)
        now = time.monotonic()
        for r in peers:
            value = store.add(f"beat/{r}", 0)
            last, since = seen[r]
            if value != last:
                seen[r] = (value, now)
            elif now - since > DEAD_AFTER_S and not world.stopping and not world.finished(store, r):
                _die(f"rank {r} stopped answering (no heartbeat for {DEAD_AFTER_S:.0f} s); stopping all ranks")
        world.quit.wait(BEAT_S)


def _watch_parent(world: World) -> None:
    parent = int(os.environ["APPLIANCE_PARENT"])
    while True:
        if os.getppid() != parent:
            _die(f"rank 0 (pid {parent}) is gone; rank {world.rank} stops")
        time.sleep(0.2)
