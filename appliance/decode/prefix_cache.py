"""The prefix cache: whole conversations kept in host memory (and on disk, prefix_disk.py), indexed by a
radix trie of token ids, so that a new prompt restores the longest prefix any earlier request shares.

Why a trie and not hashed blocks. Agent traffic diverges at arbitrary positions: the encoder drops the last
answer's reasoning (the divergence is where that answer began), a client re-tokenizes generated text, a
side request branches off the system prompt or the history. A radix trie of ids finds the exact longest
common prefix (token granularity) over every cached conversation in one walk, where hashed blocks round
every match down to a block boundary and need a block size chosen against two costs. A trie also stores a
shared prefix once (the system prompt with its tools, and every earlier turn of a conversation: committing
a turn copies only its new rows), and evicts leaves first, so a dead branch (a dropped reasoning, a side
request) goes before the trunk that many conversations share. Hashed blocks pay off for many concurrent
sequences in a paged KV pool; here one user owns one contiguous state.

A node is a run of ids at positions [start, end). It keeps, in host memory (pinned where there is a GPU)
or on disk, the compressed rows those positions complete (rows [start // m, end // m) of each row cache of
ratio m) and the checkpoints (checkpoint.py) taken at positions in (start, end]. Restoring a prefix of
length p copies the rows of the nodes on its path and the rings of one checkpoint into the live state.

Eviction (host tier, `budget` bytes): least recently used first (a node's use is the last request that
matched through it, so a trunk is never older than its leaves). A node that is also on disk only drops its
host copy; one that is not is removed, leaves only. A side request does not evict the main conversation:
the path of a longer conversation used within the last PROTECT_REQUESTS requests is evicted only after the
newly committed branch itself.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .checkpoint import RingSnapshot, host_empty_like

PROTECT_REQUESTS = 8  # a longer conversation used this recently is not evicted for a shorter one


@dataclass
class CheckpointRef:
    """The checkpoint at `position`, held in host memory, on disk (the id of the file that holds it), or both."""

    position: int
    host: RingSnapshot | None = None
    file: str | None = None


class Node:
    """Ids at positions [start, end) with their rows and the checkpoints in (start, end]."""

    def __init__(self, start: int, tokens: torch.Tensor, parent: "Node | None"):
        self.start = start
        self.tokens = tokens  # int64 [end - start], host
        self.parent = parent
        self.children: dict[int, Node] = {}  # by first id
        self.rows: dict[str, torch.Tensor] | None = None  # host rows [start // m, end // m) per row cache
        self.disk: tuple[str, int] | None = None  # (file id, the file's first position): ids and rows there
        self.ckpts: dict[int, CheckpointRef] = {}
        self.last_used = 0

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()

    @property
    def on_host(self) -> bool:
        return self.rows is not None

    def host_bytes(self) -> int:
        n = self.tokens.numel() * 8
        if self.rows is not None:
            n += sum(t.numel() * t.element_size() for t in self.rows.values())
        return n + sum(r.host.nbytes for r in self.ckpts.values() if r.host is not None)

    def __repr__(self) -> str:
        return f"Node[{self.start}, {self.end}) host={self.on_host} disk={self.disk is not None}"


@dataclass
class Match:
    """The longest cached prefix of a prompt: `length` ids along `path` (the last node may match in part)."""

    path: list[Node] = field(default_factory=list)
    length: int = 0


@dataclass
class Found:
    """A checkpoint chosen for a restore to `target`: at `position` (<= target: prefill from it; in
    [target, target + spare]: used as is)."""

    position: int
    node: Node
    ref: CheckpointRef


class PrefixCache:
    def __init__(self, budget: int, ratios: dict[str, int], notice: Callable[[str], None] | None = None):
        """`budget`: host bytes; `ratios`: row cache name -> ratio (rows per position)."""
        self.budget = budget
        self.ratios = ratios
        self.notice = notice or (lambda m: None)
        self.root = Node(0, torch.zeros(0, dtype=torch.long), None)
        self.clock = 0  # requests seen (LRU time)
        self.disk = None  # prefix_disk.DiskTier
        self.host_bytes = 0
        self.evicted = 0  # nodes dropped from host memory (tests, metrics)

    # --- walking ------------------------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def match(self, ids: torch.Tensor) -> Match:
        """The longest prefix of `ids` (int64, host) on a path of the trie."""
        node, pos, out = self.root, 0, Match()
        n = ids.numel()
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            k = min(child.tokens.numel(), n - pos)
            diff = (child.tokens[:k] != ids[pos:pos + k]).nonzero()
            m = k if diff.numel() == 0 else int(diff[0])
            out.path.append(child)
            pos += m
            if m < child.tokens.numel():
                break
            node = child
        out.length = pos
        return out

    def touch(self, nodes) -> None:
        for n in nodes:
            n.last_used = self.clock

    def checkpoint_for(self, match: Match, target: int, spare: int) -> Found | None:
        """A checkpoint at a position in [target, target + spare] reachable along `match` (its last node and
        the subtree below it: only the ids below `target` need to agree), else the last at or before
        `target` on the path. Host copies are preferred to disk ones at equal reach."""
        best = None
        if match.path and match.length >= target:
            last = match.path[-1]
            stack = [last]
            while stack:
                n = stack.pop()
                for c, ref in n.ckpts.items():
                    if target <= c <= target + spare and (best is None or (ref.host is not None, -c) >
                                                          (best.ref.host is not None, -best.position)):
                        best = Found(c, n, ref)
                if n.end < target + spare:
                    stack.extend(ch for ch in n.children.values())
        if best is not None:
            return best
        for n in match.path:
            for c, ref in n.ckpts.items():
                if c <= min(target, match.length) and (best is None or c > best.position):
                    best = Found(c, n, ref)
        return best

    def checkpoint_at(self, match: Match, position: int) -> Found | None:
        """The checkpoint at exactly `position` where `checkpoint_for` looks (on the path, or in the subtree
        of its last node), or None: how a rank finds the checkpoint rank 0's plan chose."""
        for n in match.path:
            if position in n.ckpts:
                return Found(position, n, n.ckpts[position])
        stack = list(match.path[-1].children.values()) if match.path else []
        while stack:
            n = stack.pop()
            if n.start < position:
                if position in n.ckpts:
                    return Found(position, n, n.ckpts[position])
                stack.extend(n.children.values())
        return None

    # --- data ---------------------------------------------------------------------------------------

    def rows_into(self, path: list[Node], lo: int, hi: int, rows: dict[str, torch.Tensor]) -> int:
        """Copy the rows positions [lo, hi) complete, from the nodes of `path`, into the live row tensors
        `rows` (name -> [capacity // m + 1, width]) in place. Every node concerned must be on the host."""
        copied = 0
        for name, m in self.ratios.items():
            a, b = lo // m, hi // m
            for n in path:
                s, e = max(a, n.start // m), min(b, n.end // m)
                if s >= e:
                    continue
                src = n.rows[name][s - n.start // m: e - n.start // m]
                rows[name][s:e].copy_(src, non_blocking=True)
                copied += src.numel() * src.element_size()
        return copied

    def _account(self, node: Node, sign: int) -> None:
        self.host_bytes += sign * node.host_bytes()

    def split(self, node: Node, at: int) -> Node:
        """Split `node` at position `at` (start < at < end); the node keeps [start, at) and returns the new
        child [at, end) (children, rows, disk file and checkpoints past `at` move to it)."""
        self._account(node, -1)
        k = at - node.start
        lower = Node(at, node.tokens[k:].clone(), node)
        node.tokens = node.tokens[:k].clone()
        lower.children, node.children = node.children, {int(lower.tokens[0]): lower}
        for ch in lower.children.values():
            ch.parent = lower
        if node.rows is not None:
            upper_rows, lower_rows = {}, {}
            for name, m in self.ratios.items():
                cut = at // m - node.start // m
                t = node.rows[name]
                upper_rows[name], lower_rows[name] = _host_clone(t[:cut]), _host_clone(t[cut:])
            node.rows, lower.rows = upper_rows, lower_rows
        lower.disk = node.disk
        lower.ckpts = {c: r for c, r in node.ckpts.items() if c > at}
        node.ckpts = {c: r for c, r in node.ckpts.items() if c <= at}
        lower.last_used = node.last_used
        self._account(node, 1)
        self._account(lower, 1)
        return lower

    def insert(self, ids: torch.Tensor, rows_of: Callable[[int, int], dict[str, torch.Tensor]],
               ckpts: dict[int, RingSnapshot]) -> tuple[Node | None, list[Node], dict[int, CheckpointRef]]:
        """Add the conversation `ids` (host int64): walk its cached prefix, then one new node for the rest
        with `rows_of(start, end)` (host rows [start // m, end // m) per cache); attach `ckpts` (position
        -> checkpoint) to the nodes holding their positions. Returns (the new node or None, the path,
        the checkpoint refs newly attached)."""
        match = self.match(ids)
        path, pos = match.path, match.length
        new = None
        if pos < ids.numel():
            if path and pos < path[-1].end:
                self.split(path[-1], pos)  # the path's last node keeps [start, pos)
            parent = path[-1] if path else self.root
            new = Node(pos, ids[pos:].clone(), parent)
            new.rows = rows_of(pos, ids.numel())
            parent.children[int(new.tokens[0])] = new
            path.append(new)
            self._account(new, 1)
        added = {}
        for c, ck in sorted(ckpts.items()):
            holder = next((n for n in path if n.start < c <= n.end), None)
            if holder is None or c in holder.ckpts:
                continue
            ref = holder.ckpts[c] = CheckpointRef(c, host=ck)
            added[c] = ref
            self.host_bytes += ck.nbytes
        self.touch(path)
        return new, path, added

    def load(self, nodes: list[Node], refs: list[CheckpointRef]) -> None:
        """Bring disk-only `nodes` and checkpoint `refs` to the host (raises prefix_disk.CacheFileError)."""
        files: dict[str, dict] = {}

        def read(fid: str) -> dict:
            if fid not in files:
                files[fid] = self.disk.read(fid)
            return files[fid]

        for n in nodes:
            if n.on_host:
                continue
            fid, first = n.disk
            data = read(fid)
            rows = {}
            for name, m in self.ratios.items():
                a = n.start // m - first // m
                rows[name] = _host_clone(data["rows"][name][a: a + n.end // m - n.start // m])
            self._account(n, -1)
            n.rows = rows
            self._account(n, 1)
        for ref in refs:
            if ref.host is None:
                ck = read(ref.file)["ckpts"][ref.position]
                ref.host = RingSnapshot(ck.position, {k: _host_clone(v) for k, v in ck.rings.items()})
                self.host_bytes += ref.host.nbytes

    # --- the disk tier ------------------------------------------------------------------------------

    def attach_disk(self, disk) -> None:
        """Use `disk` (prefix_disk.DiskTier) and rebuild the trie from its files, every node on disk only."""
        self.disk = disk
        paths: dict[str, torch.Tensor] = {}
        for info, tokens in disk.scan():
            prefix = paths[info.parent][: info.start] if info.parent else tokens[:0]
            full = paths[info.fid] = torch.cat((prefix, tokens))
            match = self.match(full)
            path, pos = match.path, match.length
            if pos < info.start:  # its parent's ids are not in the trie: nothing can reach it
                continue
            if pos < full.numel():
                if path and pos < path[-1].end:
                    self.split(path[-1], pos)
                parent = path[-1] if path else self.root
                node = Node(pos, full[pos:].clone(), parent)
                node.disk = (info.fid, info.start)
                parent.children[int(node.tokens[0])] = node
                path.append(node)
                self._account(node, 1)
            for c in info.checkpoints:
                holder = next((n for n in path if n.start < c <= n.end), None)
                if holder is not None and c not in holder.ckpts:
                    holder.ckpts[c] = CheckpointRef(c, file=info.fid)

    # --- eviction -----------------------------------------------------------------------------------

    def evict(self, newest: Node | None = None) -> None:
        """Drop host copies until the host bytes fit the budget (module docstring: order and protection)."""
        if self.host_bytes <= self.budget:
            return
        protected = set()
        if newest is not None:
            for leaf in self.nodes():
                if not leaf.children and leaf is not newest and leaf.end > newest.end \
                        and leaf.last_used >= self.clock - PROTECT_REQUESTS:
                    n = leaf
                    while n is not None and n is not self.root:
                        protected.add(n)
                        n = n.parent
        newest_path = set()
        n = newest
        while n is not None and n is not self.root:
            newest_path.add(n)
            n = n.parent

        def order(n: Node):  # unprotected first, then the new branch, then protected; LRU, deepest first
            return 2 if n in protected else (1 if n in newest_path else 0), n.last_used, -_depth(n)

        while self.host_bytes > self.budget:
            candidates = [n for n in self.nodes() if self._evictable(n)]
            if not candidates:
                return
            self._drop(min(candidates, key=order))

    def _evictable(self, n: Node) -> bool:
        holds = n.on_host or any(r.host is not None for r in n.ckpts.values())
        return holds and (n.disk is not None or not n.children)

    def _drop(self, n: Node) -> None:
        self.evicted += 1
        if n.disk is not None:
            self._account(n, -1)
            n.rows = None
            for c in list(n.ckpts):
                r = n.ckpts[c]
                r.host = None
                if r.file is None:
                    del n.ckpts[c]
            self._account(n, 1)
        else:
            self.remove(n)

    def remove(self, n: Node) -> None:
        """Take `n` and everything below it out of the trie."""
        for ch in list(n.children.values()):
            self.remove(ch)
        self._account(n, -1)
        if n.parent is not None and n.parent.children.get(int(n.tokens[0])) is n:
            del n.parent.children[int(n.tokens[0])]
        n.children = {}

    def forget_file(self, fid: str) -> None:
        """A disk file is gone (evicted or rejected): nothing may refer to it any more."""
        for n in list(self.nodes()):
            for c in list(n.ckpts):
                r = n.ckpts[c]
                if r.file == fid:
                    r.file = None
                    if r.host is None:
                        del n.ckpts[c]
            if n.disk is not None and n.disk[0] == fid:
                n.disk = None
                if not n.on_host and self._attached(n):
                    self.remove(n)

    def _attached(self, n: Node) -> bool:
        while n.parent is not None:
            if n.parent.children.get(int(n.tokens[0])) is not n:
                return False
            n = n.parent
        return n is self.root


def _depth(n: Node) -> int:
    d = 0
    while n.parent is not None:
        d, n = d + 1, n.parent
    return d


def _host_clone(t: torch.Tensor) -> torch.Tensor:
    out = host_empty_like(t)
    out.copy_(t)
    return out


__all__ = ["CheckpointRef", "Found", "Match", "Node", "PrefixCache"]
