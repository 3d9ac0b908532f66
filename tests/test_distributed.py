"""One model over four ranks (gloo on the CPU): the split must not change the function, and a dead rank
must stop the service, never hang it."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from .ranks import launch

APPLIANCE = [sys.executable, "-m", "appliance"]
ENV = dict(os.environ, APPLIANCE_THREADS="1")
TOKENS = 24  # greedy tokens per run: four runs a family (single and four ranks, with and without drafting)


def run(*args, timeout=300):
    p = subprocess.run([*APPLIANCE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)
    assert p.returncode == 0, p.stderr
    return p


def generate(model, ids_file, draft, devices):
    p = run("generate", "--model", model, "--ids", ids_file, "--max-tokens", TOKENS, "--ignore-eos", "--json",
            "--draft", draft, "--draft-tokens", 3, "--devices", devices)
    return json.loads(p.stdout)["ids"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v41", "deepseek_v4"])
def test_four_gloo_ranks_give_the_single_process_greedy_tokens_with_and_without_drafting(tiny_dirs, tmp_path,
                                                                                        family):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(torch.randint(0, 512, (21,)).tolist()))
    split = {}
    for draft in ("none", "auto"):
        single = generate(tiny_dirs[family], ids, draft, "cpu")
        split[draft] = generate(tiny_dirs[family], ids, draft, "cpu:4")
        assert len(single) == TOKENS and split[draft] == single, (family, draft)
    assert split["auto"] == split["none"], f"{family}: greedy drafting on four ranks left plain decoding"


FAST_SPLIT_TOL = 2.0**-16  # relative to a row's largest |logit|: float32 sums over ranks in another order


@pytest.mark.slow
def test_on_the_fast_path_four_ranks_give_one_ranks_logits_within_float32_rounding(tiny_dirs, tmp_path):
    """The fused kernels over each rank's share (the MoE's experts split by their intermediate, or whole
    experts per rank), partial sums in float32 added in rank order. `--numerics plain` for the logits: no activation
    quantization, whose rounding boundaries a reordered sum can cross (a whole e4m3 step, README "Numerics");
    measured ~2e-7 of the row maximum. Eight tokens: a call no longer than rowsplit.SPLIT_ROWS is not held by
    rows, so its sums over ranks go through their consumers (`Comm.sum_produced`), whose symmetric-memory form
    (its CPU stand-in: buffers in shared memory, read in place) gives the gathered sum's bits. Short (the
    interpreter, four ranks on two cores: minutes)."""
    model = tiny_dirs["deepseek_v41"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(torch.randint(0, 512, (8,)).tolist()))
    out = {}
    for devices, allreduce, experts in (("cpu", "auto", "auto"), ("cpu:4", "nccl", "auto"), ("cpu:4", "symm", "auto"),
                                        ("cpu:4", "nccl", "whole")):
        path = tmp_path / f"{devices.replace(':', '')}-{allreduce}-{experts}.safetensors"
        run("score", "--model", model, "--ids", ids, "--out", path, "--devices", devices, "--path", "fast",
            "--numerics", "plain", "--allreduce", allreduce, "--experts", experts)
        out[devices, allreduce, experts] = load_file(str(path))["logits"]
    want, split = out["cpu", "auto", "auto"], out["cpu:4", "nccl", "auto"]
    assert torch.equal(out["cpu:4", "symm", "auto"], split), "the symmetric sum must give the gathered sum's bits"
    top2 = want.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * FAST_SPLIT_TOL * want.abs().amax(-1)
    for placement, got in (("split experts", split), ("whole experts", out["cpu:4", "nccl", "whole"])):
        err = (got - want).abs().amax(-1) / want.abs().amax(-1)
        assert (err <= FAST_SPLIT_TOL).all(), f"{placement}: rows over {FAST_SPLIT_TOL:.3g}: {err.tolist()}"
        assert ((want.argmax(-1) == got.argmax(-1)) | ~clear).all(), placement


@pytest.mark.slow
def test_on_every_rank_the_cycles_capture_cleanly_and_replayed_with_their_collectives_give_the_eager_tokens(
        tiny_dirs, tmp_path):
    """Four gloo ranks on the fast path, each running tests/rank_replay.py in lockstep: greedy tokens from
    eager plain cycles, then from cycles replayed from their captures (the collectives replayed with them)
    without and with DSpark (a verify of k + 1 rows equals k + 1 single steps on every rank); no capture
    reads the host. Then the drafted cycles replayed with the sums as the box makes them (`--allreduce symm`:
    the producers' publishes and the consumers' waits inside their kernels, the logits read by the samplers
    where the ranks hold them): the same tokens. Three tokens after a 14-token prompt (four interpreters on
    two cores: minutes)."""
    prompt = torch.randint(0, 512, (14,)).tolist()
    argv = ["--model", str(tiny_dirs["deepseek_v41"]), "--devices", "cpu:4", "--prompt", json.dumps(prompt),
            "--tokens", "3", "--draft", "dspark"]
    ranks = launch("tests.rank_replay", [*argv, "--out", str(tmp_path)], tmp_path, world=4, timeout=900)
    want = ranks[0]["eager"]
    assert len(want) == 3
    for r in ranks:
        assert r["violations"] == [], f"rank {r['rank']}: {r['violations']}"
        assert r["eager"] == want, f"rank {r['rank']} eager {r['eager']} != rank 0's {want}"
        assert r["replayed"] == {"none": want, "dspark": want}, f"rank {r['rank']}: {r['replayed']} != {want}"
    symm = tmp_path / "symm"
    symm.mkdir()
    ranks = launch("tests.rank_replay", [*argv, "--allreduce", "symm", "--runs", "drafted", "--out", str(symm)],
                   symm, world=4, timeout=900)
    for r in ranks:
        assert r["violations"] == [], f"rank {r['rank']} (symm): {r['violations']}"
        assert r["replayed"] == {"dspark": want}, f"rank {r['rank']} (symm): {r['replayed']} != {want}"


@pytest.mark.parametrize("family", ["deepseek_v41", "deepseek_v4_0731"])
def test_four_gloo_ranks_give_teacher_forced_logits_within_1e_5(tiny_dirs, tmp_path, family):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(torch.randint(0, 512, (70,)).tolist()))
    out = {}
    for devices in ("cpu", "cpu:4"):
        path = tmp_path / f"{devices.replace(':', '')}.safetensors"
        run("score", "--model", tiny_dirs[family], "--ids", ids, "--out", path, "--devices", devices)
        out[devices] = load_file(str(path))["logits"]
    err = (out["cpu"] - out["cpu:4"]).abs().max().item()
    assert err <= 1e-5, f"{family}: max |delta| {err:.3g}"


def test_a_killed_rank_stops_the_whole_service_with_a_message_naming_it(tiny_dirs):
    proc = subprocess.Popen([*APPLIANCE, "serve", "--model", str(tiny_dirs["deepseek_v41"]), "--devices", "cpu:4",
                             "--port", "0"], stderr=subprocess.PIPE, text=True, env=ENV)
    pids, lines = {}, []
    deadline = time.monotonic() + 120
    while len(pids) < 3 and time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        m = re.search(r"started rank (\d+) \(pid (\d+)\)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    assert len(pids) == 3, "".join(lines)
    while time.monotonic() < deadline and not lines[-1].startswith("appliance: ready"):
        lines.append(proc.stderr.readline())  # serving: the ranks loaded and warmed up together
    assert lines[-1].startswith("appliance: ready"), "".join(lines)
    os.kill(pids[2], signal.SIGKILL)
    killed = time.monotonic()
    try:
        _, rest = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the service did not exit within 30 s of a rank's death")
    assert time.monotonic() - killed < 5, "the service must end within 5 s of a rank's death"
    assert proc.returncode != 0
    assert "rank 2" in rest, rest
    for pid in pids.values():  # no orphan rank left behind
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"rank process {pid} is still running")


@pytest.mark.slow
def test_a_four_rank_server_idles_past_the_collective_timeout_and_then_serves(tiny_dirs):
    """The followers wait for the next request without a timeout: a collective's (shortened to 4 s here by
    APPLIANCE_COLLECTIVE_TIMEOUT_S; 20 s by default) passes three times over and the box still serves."""
    from .server_harness import ServerProcess, child_env, generate, open_ws, token_ids

    server = ServerProcess("--model", str(tiny_dirs["deepseek_v41"]), "--devices", "cpu:4",
                           env=child_env(APPLIANCE_THREADS="1", APPLIANCE_COLLECTIVE_TIMEOUT_S="4"))
    try:
        time.sleep(12)  # ready: the ranks have met and loaded; the followers wait for a job
        assert server.proc.poll() is None, "".join(server.lines)
        with open_ws(server, token=None) as ws:
            json.loads(ws.recv(timeout=30))  # hello
            frames = generate(ws, "after-idle", [5, 6, 7, 8], 6)
        assert frames[-1]["type"] == "done" and len(token_ids(frames)) == 6, frames[-1]
        assert "rank" not in "".join(line for line in server.lines if "error" in line)
    finally:
        assert server.stop() == 0, "".join(server.lines)


def test_the_four_b300_plan_for_the_released_v41_flash_fits(tmp_path):
    from .conftest import DATA

    (tmp_path / "config.json").write_text((DATA / "deepseek-v41-flash-config.json").read_text())
    p = run("info", "--model", tmp_path, "--devices", 4, "--gpu-memory", "288GB", "--context", 855000, "--json")
    plan = json.loads(p.stdout)["plan"]
    assert plan["fits"] and plan["free_per_rank"] > 0
    assert plan["per_rank"]["decode_state"] > 855000 * 890  # the whole compressed KV on every rank
    assert 60e9 < plan["per_rank"]["weights"] < 100e9  # a quarter of the experts, the rest mostly replicated


def test_the_fixed_order_sum_adds_in_rank_order_and_the_collectives_bench_runs_on_four_ranks():
    from kernels import rank_sum

    parts = torch.randn(4, 3, 50) * torch.logspace(-8, 8, 50)  # magnitudes where the order of the adds shows
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert torch.equal(rank_sum.fast(list(parts)), want)
    assert torch.equal(rank_sum.fast(list(parts[:, 1:2])), want[1:2])  # a row's sum does not depend on the others
    p = run("bench", "collectives", "--devices", "cpu:4", "--repeats", 2, "--json")
    report = json.loads(p.stdout)
    assert report["ranks"] == 4 and report["backend"] == "gloo"
    assert {r["allreduce"] for r in report["runs"]} == {"nccl"} and all(r["us"]["median"] > 0 for r in report["runs"])


def test_a_normal_exit_ends_the_watchers_then_destroys_the_process_group():
    """appliance/parallel/world.py `_exit_normally` (atexit): the rank says it is done, its watcher threads
    end and its process group is destroyed before the interpreter's teardown (a gloo group left to it once
    aborted a rank of four after its work: exit code -6)."""
    from appliance.parallel import world as w

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        world = w.World(0, 1, "cpu")
        watcher = threading.Thread(target=world.quit.wait)  # leaves when the rank quits
        watcher.start()
        w._exit_normally(world, store, [watcher])
        assert not watcher.is_alive() and not torch.distributed.is_initialized()
        assert store.get("done/0") == b"1"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
