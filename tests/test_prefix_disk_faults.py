"""The prefix cache's disk tier under faults: whatever the disk does, a request ends with its one terminal event
(or frame), the live state stays, the failure is a notice (in the server's log) and a count by operation,
and the tier turns itself off after failures in a row; at start, damaged and temporary files are removed and
reported, every file in the directory (another engine's too) counts toward the budget, which holds from
the start. The write is made to fail as a read-only directory (safetensors' own error) or a full disk (the
operating system's, after part of the file) makes it fail: the suite runs as root, whom permissions do not
stop."""

import errno
import json
import os
import shutil
import time

import pytest
import torch
from safetensors import SafetensorError

from appliance.api import Done, Error, Request
from appliance.decode import prefix_disk
from appliance.decode.loop import RequestLoop
from appliance.decode.prefix_disk import FAILURES_OFF, SUFFIX, TMP_SUFFIX
from appliance.decode.session import DecodeSession
from appliance.options import RunOptions

from .conftest import load
from .server_harness import InProcessServer, generate, open_ws, recv


@pytest.fixture(scope="module")
def lm():
    return load(None)  # the embedded V4.1 model, reference path


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def loop_of(lm, heard: list, **options) -> RequestLoop:
    options = dict(chunk=32, checkpoint_stride=32, **options)
    return RequestLoop(DecodeSession(lm, RunOptions(**options), capacity=1024, notice=heard.append), lm.tokenizer)


def run(loop: RequestLoop, ids: list[int], n: int = 3) -> list:
    return list(loop.run(Request(id="r", input_ids=ids, max_tokens=n, ignore_eos=True)))


def read_only(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")


def disk_full(tensors, path, metadata=None):
    with open(path, "wb") as f:  # part of the file made it before the disk filled
        f.write(b"\0" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fault", [read_only, disk_full], ids=["read-only", "full"])
def test_a_failing_write_ends_each_request_once_keeps_the_state_and_turns_the_tier_off_after_failures_in_a_row(
        lm, tmp_path, monkeypatch, fault):
    heard = []
    loop = loop_of(lm, heard, prefix_cache_dir=tmp_path)
    monkeypatch.setattr(prefix_disk, "save_file", fault)
    for turn in range(FAILURES_OFF):  # new conversations: each one's file fails
        conversation = ids_of(40, turn)
        events = run(loop, conversation)
        assert [type(e) for e in events if isinstance(e, Done | Error)] == [Done], events[-2:]
    conversation += [i for e in events for i in getattr(e, "ids", [])] + ids_of(5, 9)
    events = run(loop, conversation)  # the last one goes on: its prefix is restored from the live state
    assert isinstance(events[-1], Done) and events[-1].usage["cached_tokens"] >= 40
    disk = loop.session.timeline.cache.disk
    assert loop.session.disk_errors["write"] == FAILURES_OFF  # the last turn found the tier off: not tried
    assert sum("write failed" in m for m in heard) == FAILURES_OFF, heard
    assert sum(f"failed {FAILURES_OFF} times in a row; off" in m for m in heard) == 1, heard
    assert not disk.available() and list(tmp_path.iterdir()) == []  # nothing left behind, no temporary file
    monkeypatch.undo()  # the disk works again
    disk.off_until = time.monotonic()  # and the retry time has come
    events = run(loop, ids_of(40, 99))
    assert isinstance(events[-1], Done) and any("trying the disk tier" in m for m in heard)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) >= 1


def test_damaged_temporary_and_foreign_files_are_handled_at_start_and_the_budget_holds_from_the_start(lm, tmp_path):
    heard = []
    first = loop_of(lm, heard, prefix_cache_dir=tmp_path)
    for seed in range(4):  # four conversations, four files
        run(first, ids_of(60, 10 + seed))
    ours = sorted(tmp_path.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    assert len(ours) == 4
    foreign_dir = tmp_path / "plain"
    run(loop_of(load(None, numerics="plain"), [], numerics="plain", prefix_cache_dir=foreign_dir), ids_of(60, 30))
    [foreign] = foreign_dir.glob(f"*{SUFFIX}")
    foreign = shutil.move(str(foreign), tmp_path / f"other{SUFFIX}")
    shutil.rmtree(foreign_dir)
    blob = ours[0].read_bytes()
    ours[0].write_bytes(blob[: len(blob) // 2])  # truncated
    damaged = bytearray(ours[1].read_bytes())
    damaged[8:40] = b"\xff" * 32  # the header's JSON broken
    ours[1].write_bytes(bytes(damaged))
    stale = tmp_path / f".deadbeef{TMP_SUFFIX}"
    stale.write_bytes(b"\0" * 10_000)  # a write killed half way
    old = time.time() - 3600
    os.utime(foreign, (old, old))  # the oldest file in the directory
    budget = ours[2].stat().st_size + ours[3].stat().st_size + 1000  # room for our two good files only
    heard.clear()
    loop_of(lm, heard, prefix_cache_dir=tmp_path, prefix_cache_disk_gb=budget / 1e9)
    said = "\n".join(heard)
    assert f"{ours[0].name}: unreadable" in said and f"{ours[1].name}: unreadable" in said, said
    assert f"{stale.name}: left by an interrupted write; ignored and removed" in said, said
    assert "other.prefix: made by another model" in said and "counted toward the budget" in said, said
    assert "other.prefix (another engine's) removed" in said, said  # the oldest goes first
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([ours[2].name, ours[3].name]), left
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= budget


def test_a_restart_with_a_smaller_budget_evicts_at_start_oldest_first(lm, tmp_path):
    heard = []
    first = loop_of(lm, heard, prefix_cache_dir=tmp_path)
    for seed in range(3):
        run(first, ids_of(60, 20 + seed))
        time.sleep(0.01)
    files = sorted(tmp_path.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    budget = files[-1].stat().st_size + 10
    loop_of(lm, heard, prefix_cache_dir=tmp_path, prefix_cache_disk_gb=budget / 1e9)
    assert [p.name for p in tmp_path.glob(f"*{SUFFIX}")] == [files[-1].name]


def test_the_servers_log_and_metrics_carry_the_disk_tiers_notices_and_failures(tmp_path, monkeypatch):
    from appliance.engine import Engine

    (tmp_path / f".cafe{TMP_SUFFIX}").write_bytes(b"\0" * 100)
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a cache file")
    said: list[str] = []
    options = RunOptions(prefix_cache_dir=tmp_path, chunk=32)
    server = InProcessServer(None, load=lambda status: Engine.load(options, status=status), say=said.append)
    try:
        log = "\n".join(said)
        assert f".cafe{TMP_SUFFIX}: left by an interrupted write" in log and f"junk{SUFFIX}: unreadable" in log, log
        monkeypatch.setattr(prefix_disk, "save_file", read_only)
        with open_ws(server, token=None) as ws:
            recv(ws)
            for k in range(2):
                frames = generate(ws, f"r{k}", ids_of(20, 40 + k), 2)
                assert [f["type"] for f in frames].count("done") == 1 and frames[-1]["type"] == "done", frames
            server.engine.wait_idle()  # a request's conversation is filed after its done
            ws.send(json.dumps({"type": "ping", "t": 1}))
            assert recv(ws)["type"] == "pong"  # no second terminal frame came before it
        assert sum("write failed" in m and "Permission denied" in m for m in said) == 2, said
        scrape = server.app.metrics
        server.app.metrics.engine_stats(server.engine.stats())
        assert scrape.disk_errors.labels("write")._value.get() == 2
    finally:
        server.stop()
