"""The disk tier of the prefix cache (`--prefix-cache-dir`): cached conversations that survive a restart.

Each commit of a conversation (the end of a request) writes one immutable file, `<id>.prefix`
(safetensors): the ids of a new run of positions [start, end), the compressed rows they complete, the
checkpoints taken in it, and in its metadata the format, the engine's fingerprint, the parent file (the one
that holds position start - 1 of the same conversation; none from position 0) and a CRC-32 of every
tensor. Files are written to a temporary name and renamed, so a crash leaves no half file under a real
name. At start the headers are read (not the data) and the trie is rebuilt with every node on disk; the
data is read when a restore needs it.

Validation. The fingerprint hashes what the state's values depend on: config.json, tokenizer.json (Engram
hashes ids through it), each weight file's name, size, header and sampled bytes, the numerics, dtype,
op path, index-key order, drafter kind, the state's layout (ring and row shapes, dtypes, spare) and the
rank. A file with another fingerprint (or of another version of the format) is never used: it is reported
once and left alone (it may belong to another model sharing the directory), but it counts toward the
budget like every file there. A file that cannot be read (truncated, a damaged header), whose tensors do
not have the expected names and shapes, or whose checksum fails is reported and removed, and the request
goes on without it (prefilling what it would have restored); so is a temporary file an interrupted write
left behind.

Eviction: least recently used first (a file's mtime is touched when it is read), among this engine's files
that no other file names as parent and every foreign file, until the directory's files fit `budget` bytes:
at start, and before each write makes room for the new file.

Best effort. The tier never changes a request's outcome: whatever a read, write, rename or eviction raises
(a read-only or full directory: safetensors' own errors as well as OSError) is one notice and a count in
`errors` by operation, the conversation stays in host memory, and the request ends as it would have. After
FAILURES_OFF failures in a row the tier turns itself off for OFF_S seconds (one notice each way): no writes
or evictions meanwhile.
"""

import hashlib
import json
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .checkpoint import RingSnapshot

FORMAT = "decode-appliance-prefix-cache/1"
SUFFIX = ".prefix"
TMP_SUFFIX = ".tmp"  # a file being written: `.<id>.tmp`, renamed to `<id>.prefix` when whole
SAMPLE_BYTES = 1 << 16  # weight bytes hashed per sample
SAMPLES = 4  # samples per weight file
FAILURES_OFF = 3  # failed operations in a row after which the tier turns itself off
OFF_S = 60.0  # how long it stays off before it is tried again
OPS = ("read", "write", "evict", "scan")


class CacheFileError(Exception):
    """A cache file that cannot be used (`fid`); the message says which and why."""

    def __init__(self, message: str, fid: str = ""):
        super().__init__(message)
        self.fid = fid


@dataclass
class Layout:
    """What a file's tensors must look like: ring name -> (shape, dtype), row cache name -> (ratio, width,
    dtype)."""

    rings: dict[str, tuple[tuple[int, ...], torch.dtype]]
    rows: dict[str, tuple[int, int, torch.dtype]]
    spare: int

    def describe(self) -> str:
        rings = {k: [list(s), str(d)] for k, (s, d) in sorted(self.rings.items())}
        rows = {k: [m, w, str(d)] for k, (m, w, d) in sorted(self.rows.items())}
        return json.dumps({"rings": rings, "rows": rows, "spare": self.spare}, sort_keys=True)


@dataclass
class FileInfo:
    fid: str
    path: Path
    start: int
    end: int
    parent: str  # "" from position 0
    checkpoints: list[int] = field(default_factory=list)
    nbytes: int = 0
    used: float = 0.0


def _weights_identity(model_dir: Path, h) -> None:
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            h.update(head + fh.read(min(n, 1 << 26)))
            data0 = 8 + n
            for i in range(SAMPLES):
                fh.seek(data0 + (size - data0) * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))


def fingerprint(model_dir: Path, run: dict, layout: Layout) -> str:
    """The engine's identity for cache files: the model directory's contents (module docstring), the run
    facts that change the state's values (`run`: numerics, dtype, path, ...) and the state's layout."""
    h = hashlib.sha256(FORMAT.encode())
    model_dir = Path(model_dir)
    for name in ("config.json", "tokenizer.json"):
        p = model_dir / name
        h.update(name.encode() + (p.read_bytes() if p.is_file() else b"-"))
    _weights_identity(model_dir, h)
    h.update(json.dumps(run, sort_keys=True, default=str).encode())
    h.update(layout.describe().encode())
    return h.hexdigest()[:32]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


@dataclass
class Foreign:
    """A file of another engine (fingerprint) or format version: never read, counted, evicted by age."""

    path: Path
    nbytes: int
    used: float


class DiskTier:
    def __init__(self, root: Path, fp: str, layout: Layout, budget: int, notice=None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fp = fp
        self.layout = layout
        self.budget = budget
        self.notice = notice or (lambda m: None)
        self.files: dict[str, FileInfo] = {}
        self.foreign: dict[Path, Foreign] = {}
        self.rejected: list[str] = []  # messages of files not used (tests, the CLI)
        self.errors = dict.fromkeys(OPS, 0)  # failed operations by kind (the server's metric)
        self.failures = 0  # in a row
        self.off_until: float | None = None  # monotonic time the tier is tried again; None: on

    def _reject(self, message: str) -> None:
        self.rejected.append(message)
        self.notice(message)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values()) + sum(f.nbytes for f in self.foreign.values())

    # --- best effort ------------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether writes and evictions are tried now (the tier is not off after failures)."""
        if self.off_until is None:
            return True
        if time.monotonic() < self.off_until:
            return False
        self.off_until = None
        self.notice(f"prefix cache: trying the disk tier in {self.root} again")
        return True

    def failed(self, op: str, error: BaseException) -> None:
        """One failed operation: a notice, a count; the tier off after FAILURES_OFF in a row."""
        self.errors[op] += 1
        self.failures += 1
        what = f"{type(error).__name__}: {error}"
        self.notice(f"prefix cache: {op} failed in {self.root} ({what}); the conversation stays in host memory")
        if self.failures >= FAILURES_OFF:
            self.failures, self.off_until = 0, time.monotonic() + OFF_S
            self.notice(f"prefix cache: the disk tier in {self.root} failed {FAILURES_OFF} times in a row; off "
                        f"for {OFF_S:g} s (host memory only meanwhile)")

    def succeeded(self) -> None:
        self.failures = 0

    # --- start-up ---------------------------------------------------------------------------------------

    def scan(self) -> list[tuple[FileInfo, torch.Tensor]]:
        """Every usable file and its ids, parents before children, within the budget; the others are
        reported (foreign files kept and counted, broken ones and leftover temporary files removed)."""
        for tmp in sorted(self.root.glob(f".*{TMP_SUFFIX}")):
            self._drop_broken(tmp, "left by an interrupted write")
        found: dict[str, FileInfo] = {}
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                stat = path.stat()
            except Exception as e:  # noqa: BLE001 - a truncated file, a damaged header: not usable by anyone
                self._drop_broken(path, f"unreadable ({type(e).__name__}: {e})")
                continue
            if meta.get("format") != FORMAT or meta.get("fingerprint") != self.fp:
                why = (f"not a cache file of this version (format {meta.get('format')!r}, expected {FORMAT!r})"
                       if meta.get("format") != FORMAT else
                       f"made by another model or with other numerics, dtype, path or drafter (fingerprint "
                       f"{meta.get('fingerprint')}, this engine {self.fp})")
                self._reject(f"prefix cache: {path.name}: {why}; ignored (counted toward the budget)")
                self.foreign[path] = Foreign(path, stat.st_size, stat.st_mtime)
                continue
            try:
                info = FileInfo(path.stem, path, int(meta["start"]), int(meta["end"]), meta["parent"],
                                json.loads(meta["checkpoints"]), stat.st_size, stat.st_mtime)
            except (KeyError, ValueError) as e:
                self._drop_broken(path, f"bad metadata ({e})")
                continue
            found[info.fid] = info
        ordered = []
        for info in sorted(found.values(), key=lambda f: (f.start, f.used)):
            parent = found.get(info.parent)
            if info.parent and (parent is None or parent.fid not in self.files
                                or not parent.start < info.start <= parent.end):
                self._drop_broken(info.path, f"its parent {info.parent or '-'} is missing")
                continue
            try:
                with safe_open(str(info.path), framework="pt") as f:
                    tokens = f.get_tensor("tokens")
                if tokens.dtype != torch.long or tokens.numel() != info.end - info.start:
                    raise CacheFileError(f"ids are {tokens.dtype} x {tokens.numel()}")
            except Exception as e:  # noqa: BLE001
                self._drop_broken(info.path, f"unreadable ids ({e})")
                continue
            self.files[info.fid] = info
            ordered.append((info, tokens))
        removed = set(self.evict(set()))  # the budget holds from the start
        return [(info, tokens) for info, tokens in ordered if info.fid not in removed]

    def _drop_broken(self, path: Path, why: str) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self.failed("scan", e)
            self._reject(f"prefix cache: {path.name}: {why}; ignored (it could not be removed)")
            return
        self._reject(f"prefix cache: {path.name}: {why}; ignored and removed")

    # --- files ------------------------------------------------------------------------------------------

    @staticmethod
    def tensors(tokens: torch.Tensor, rows: dict[str, torch.Tensor], ckpts: dict[int, RingSnapshot]) -> dict:
        """What a file of these ids, rows and checkpoints holds, by name (`write` takes it; its bytes are
        what eviction makes room for)."""
        out = {"tokens": tokens.contiguous()}
        out.update({f"rows.{name}": t.contiguous() for name, t in rows.items()})
        for c, ck in ckpts.items():
            ck.wait()
            out.update({f"ckpt.{c}.{name}": t.contiguous() for name, t in ck.rings.items()})
        return out

    def write(self, parent: str, start: int, tensors: dict[str, torch.Tensor], ckpts: list[int]) -> str:
        """One file of `tensors` (`DiskTier.tensors`: ids at positions [start, start + n), their rows, the
        checkpoints at `ckpts`). Raises whatever the filesystem or safetensors raise, leaving no temporary
        file."""
        fid = uuid.uuid4().hex[:20]
        tokens = tensors["tokens"]
        end = start + tokens.numel()
        meta = {"format": FORMAT, "fingerprint": self.fp, "parent": parent, "start": str(start), "end": str(end),
                "checkpoints": json.dumps(sorted(ckpts)),
                "crc32": json.dumps({k: _crc(t) for k, t in tensors.items()})}
        path = self.root / f"{fid}{SUFFIX}"
        tmp = self.root / f".{fid}{TMP_SUFFIX}"
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.files[fid] = FileInfo(fid, path, start, end, parent, sorted(ckpts), path.stat().st_size, time.time())
        return fid

    def read(self, fid: str) -> dict:
        """{"tokens", "rows": name -> tensor, "ckpts": position -> RingSnapshot}, checked against the layout and
        the checksums. Raises CacheFileError (and removes the file) when it cannot be used."""
        info = self.files.get(fid)
        if info is None:
            raise CacheFileError(f"prefix cache: file {fid} is no longer there", fid)
        try:
            tensors = load_file(str(info.path))
            with safe_open(str(info.path), framework="pt") as f:
                crc = json.loads((f.metadata() or {})["crc32"])
            out = self._check(info, tensors, crc)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the file is not used again
            self.errors["read"] += 1
            self.remove(fid)
            why = str(e) if isinstance(e, CacheFileError) else f"{type(e).__name__}: {e}"
            raise CacheFileError(f"prefix cache: {info.path.name}: corrupted ({why}); ignored and removed",
                                 fid) from None
        now = time.time()
        os.utime(info.path, (now, now))
        info.used = now
        return out

    def _check(self, info: FileInfo, tensors: dict, crc: dict) -> dict:
        lay = self.layout
        expect = {"tokens": ((info.end - info.start,), torch.long)}
        for name, (m, w, dt) in lay.rows.items():
            expect[f"rows.{name}"] = ((info.end // m - info.start // m, w), dt)
        for c in info.checkpoints:
            for name, (shape, dt) in lay.rings.items():
                expect[f"ckpt.{c}.{name}"] = (tuple(shape), dt)
        if set(tensors) != set(expect):
            odd = sorted(set(tensors) ^ set(expect))
            raise CacheFileError(f"tensor {odd[0]} {'unexpected' if odd[0] in tensors else 'missing'}")
        for name, (shape, dt) in expect.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise CacheFileError(f"{name} is {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}")
            if _crc(t) != crc.get(name):
                raise CacheFileError(f"checksum of {name} differs")
        ckpts = {c: RingSnapshot(c, {name: tensors[f"ckpt.{c}.{name}"] for name in lay.rings})
                 for c in info.checkpoints}
        rows = {name: tensors[f"rows.{name}"] for name in lay.rows}
        return {"tokens": tensors["tokens"], "rows": rows, "ckpts": ckpts}

    def remove(self, fid: str) -> None:
        """Forget file `fid` and delete it (a delete that fails is reported, the file forgotten all the same:
        it is never read again)."""
        info = self.files.pop(fid, None)
        if info is not None:
            try:
                info.path.unlink(missing_ok=True)
            except OSError as e:
                self.failed("evict", e)

    def evict(self, keep: set[str], room: int = 0) -> list[str]:
        """Remove the least recently used files (this engine's that no other file names as parent and are
        not in `keep`, and foreign ones) until the directory holds `room` more bytes within the budget;
        returns this engine's file ids removed."""
        removed = []
        while self.nbytes + room > self.budget:
            parents = {f.parent for f in self.files.values()}
            ours = [(f.used, f.fid) for f in self.files.values() if f.fid not in parents and f.fid not in keep]
            theirs = [(f.used, f.path) for f in self.foreign.values()]
            if not ours and not theirs:
                break
            _, victim = min(ours + theirs, key=lambda c: c[0])
            if isinstance(victim, Path):
                del self.foreign[victim]
                try:
                    victim.unlink(missing_ok=True)
                except OSError as e:
                    self.failed("evict", e)
                self.notice(f"prefix cache: {victim.name} (another engine's) removed: the directory is over "
                            f"--prefix-cache-disk-gb")
            else:
                self.remove(victim)
                removed.append(victim)
        return removed
