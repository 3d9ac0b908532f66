"""`appliance probe` against a real server: every metric with its percentiles in the JSON, the per-request
files, a valid PNG, and the exit codes (3 SLO missed, 4 busy, 5 unreachable, 2 no token); plus the
statistics and the timing reconstruction on their own."""

import asyncio
import csv
import json
import socket
import subprocess
import sys

import orjson
import pytest
from click.testing import CliRunner

from server.probe import stats as probe_stats
from server.probe.client import ProbeConfig, ProbeRun, RequestRecord, measure_one
from tests.server_harness import ROOT, TOKEN, ServerProcess, child_env, open_ws, recv


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("probe") / "token"
    f.write_text(TOKEN)
    return f


@pytest.fixture(scope="module")
def server(token_file):
    s = ServerProcess("--chunk", "16", "--token-file", str(token_file), "--on-busy", "reject")
    yield s
    assert s.stop() == 0


def probe(*args, url=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "appliance", "probe", *([url] if url else []), *args],
                          capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=timeout)


def test_the_probe_json_has_every_metric_with_its_percentiles_and_the_files_are_written(server, token_file,
                                                                                         tmp_path):
    out = {k: tmp_path / f"probe.{k}" for k in ("json", "jsonl", "csv", "png")}
    r = probe("--requests", "4", "--warmup", "1", "--isl", "12", "--osl", "5", "--token-file", str(token_file),
              "--json", str(out["json"]), "--jsonl", str(out["jsonl"]), "--csv", str(out["csv"]),
              "--plot", str(out["png"]), url=f"127.0.0.1:{server.port}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out["json"].read_text())
    assert set(doc["metrics"]) == set(probe_stats.METRICS)
    for name, row in doc["metrics"].items():
        assert set(row) == set(probe_stats.STATS), name
    m = doc["metrics"]
    for name in ("ttft_ms", "t2t_ms", "server_ttft_ms", "overhead_ms", "tpot_ms", "tokens_per_s", "max_stall_ms",
                 "e2e_ms"):
        assert m[name]["n"] == 4 and m[name]["min"] <= m[name]["p50"] <= m[name]["p99"] <= m[name]["max"], name
    assert m["itl_ms"]["n"] == 4 * 4  # every gap of every measured request, warm-up excluded
    assert m["prompt_tokens"]["min"] == m["prompt_tokens"]["max"] == 12
    assert m["output_tokens"]["min"] == m["output_tokens"]["max"] == 5
    assert m["accepted_length"]["n"] == 0  # no drafting on this server
    assert m["t2t_ms"]["min"] > 0 and m["ttft_ms"]["p50"] >= m["server_ttft_ms"]["p50"] > 0
    assert doc["finish_reasons"] == {"length": 4} and len(doc["per_request"]) == 4
    assert doc["config"]["token"] is None  # never written out
    lines = out["jsonl"].read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["warmup"] is True
    rows = list(csv.DictReader(out["csv"].open()))
    assert len(rows) == 5 and rows[1]["finish_reason"] == "length"
    assert "ttft_ms" in r.stdout and "p99" in r.stdout  # the table

    png = out["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(out["png"]))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_slo_violations_exit_3_and_met_slos_exit_0(server, token_file):
    common = ("--requests", "2", "--warmup", "0", "--isl", "4", "--osl", "3", "--token-file", str(token_file))
    missed = probe(*common, "--slo", "ttft_ms=0.001,p99_itl_ms=100000", url=server.url)
    assert missed.returncode == 3, missed.stderr
    assert "SLO ttft_ms: max ttft_ms" in missed.stdout and "MISSED" in missed.stdout
    met = probe(*common, "--slo", "ttft_ms=600000,tpot_ms=600000,p99_itl_ms=600000,tokens_per_s=0.001",
                url=server.url)
    assert met.returncode == 0, met.stderr
    assert "MISSED" not in met.stdout


def test_the_probe_exits_4_when_the_box_is_busy(server, token_file):
    with open_ws(server) as holder:
        assert recv(holder)["state"] == "ready"
        r = probe("--requests", "1", "--token-file", str(token_file), url=server.url)
    assert r.returncode == 4, r.stderr
    assert "busy" in r.stderr and "retry in" in r.stderr


def test_the_probe_exits_5_when_nothing_listens_and_2_without_the_token(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = probe("--requests", "1", url=f"ws://127.0.0.1:{port}/v1/stream")
    assert r.returncode == 5 and "unreachable" in r.stderr
    r = probe("--requests", "1", url=server.url)
    assert r.returncode == 2 and "401" in r.stderr and r.stderr.count("\n") == 1


def test_plot_without_matplotlib_fails_first_with_the_install_hint(monkeypatch, tmp_path):
    from appliance.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = CliRunner().invoke(main, ["probe", "ws://127.0.0.1:1/v1/stream", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and "pip install 'decode-appliance[plot]'" in r.output


def test_bad_probe_options_are_one_line_errors(tmp_path):
    from appliance.cli import main

    runner = CliRunner()
    for args, text in ((["--slo", "ttft=3"], "unknown metric"), (["--slo", "ttft_ms"], "NAME=VALUE"),
                       (["--requests", "0"], "--requests 0"), (["--isl", "3", "--prompt-file", "x"], "not both")):
        r = runner.invoke(main, ["probe", *args])
        assert r.exit_code == 2 and text in r.output, (args, r.output)


# --- statistics and timing, without a server -----------------------------------------------------------


def test_describe_gives_population_std_and_interpolated_percentiles():
    d = probe_stats.describe([4.0, 1.0, 3.0, 2.0, None])
    assert d["n"] == 4 and d["mean"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    assert d["p50"] == 2.5 and abs(d["p90"] - 3.7) < 1e-9 and abs(d["std"] - 1.118033988749895) < 1e-12
    assert probe_stats.describe([])["p99"] is None and probe_stats.describe([])["n"] == 0


def test_slo_keys_pick_a_statistic_and_a_direction():
    slos = {s.key: s for s in probe_stats.parse_slo("ttft_ms=500, p99_itl_ms=80,tokens_per_s=20,mean_tpot_ms=30")}
    assert (slos["ttft_ms"].stat, slos["p99_itl_ms"].stat) == ("max", "p99")
    assert (slos["tokens_per_s"].stat, slos["mean_tpot_ms"].stat) == ("min", "mean")
    metrics = {"ttft_ms": {"max": 400}, "itl_ms": {"p99": 90}, "tokens_per_s": {"min": 25}, "tpot_ms": {"mean": 30}}
    results = {r["slo"]: r["ok"] for r in probe_stats.check_slos(list(slos.values()), {"metrics": metrics})}
    assert results == {"ttft_ms": True, "p99_itl_ms": False, "tokens_per_s": True, "mean_tpot_ms": True}


class ScriptedSocket:
    def __init__(self, frames):
        self.frames = [orjson.dumps(f).decode() for f in frames]
        self.sent = []

    async def send(self, text):
        self.sent.append(text)

    async def recv(self):
        await asyncio.sleep(0.01)
        return self.frames.pop(0)


def test_tokens_of_a_merged_delta_are_dated_back_by_their_server_times():
    frames = [{"type": "started"}, {"type": "delta", "token_ids": [1], "t_ms": [50.0]},
              {"type": "delta", "token_ids": [2, 3, 4], "t_ms": [60.0, 70.0, 80.0]},
              {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 4},
               "timings": {"queue_ms": 1.0, "ttft_ms": 5.0}, "speculative": {"mean_accepted": 2.0}}]
    rec = asyncio.run(measure_one(ScriptedSocket(frames), {"id": "x"}, 0, False, 5))
    assert rec.itl_ms[1:] == pytest.approx([10.0, 10.0], abs=1e-6)  # inside the merged frame: exact gaps
    assert sum(rec.itl_ms) == pytest.approx(rec.token_ms[-1] - rec.token_ms[0])
    assert rec.output_tokens == 4 and rec.server_ttft_ms == 6.0 and rec.accepted_length == 2.0
    assert rec.overhead_ms == pytest.approx(rec.ttft_ms - 6.0) and rec.max_stall_ms == max(rec.itl_ms)


def test_the_table_lists_every_metric():
    recs = [RequestRecord(0, False, 3, 2, "length", ttft_ms=5.0, itl_ms=[1.0], token_ms=[5.0, 6.0])]
    run = ProbeRun(ProbeConfig(), {"model": "m"}, recs)
    text = probe_stats.table(run, probe_stats.summarize(run))
    assert all(name in text for name in probe_stats.METRICS) and "finish reasons: length 1" in text


def test_server_modules_never_import_torch():
    code = ("import sys, server.app, server.probe.client, server.probe.stats, server.protocol, server.gate, "
            "server.notify, server.gpu, server.metrics, server.service\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=child_env())
    assert r.returncode == 0, r.stderr


def test_the_probe_measures_an_openai_compatible_server_with_the_same_metrics_and_slo_gate(server, token_file,
                                                                                           tmp_path):
    out = tmp_path / "openai.json"
    common = ("--api", "openai", "--requests", "2", "--warmup", "1", "--isl", "70", "--osl", "4", "--token-file",
              str(token_file))
    r = probe(*common, "--json", str(out), url=f"http://127.0.0.1:{server.port}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["metrics"]) == set(probe_stats.METRICS) and doc["hello"]["api"] == "openai"
    m = doc["metrics"]
    assert m["output_tokens"]["min"] == m["output_tokens"]["max"] == 4  # ignore_eos: exact
    assert m["ttft_ms"]["n"] == 2 and 0 < m["ttft_ms"]["min"] <= m["e2e_ms"]["min"]
    assert m["tpot_ms"]["n"] == 2 and m["prompt_tokens"]["min"] == m["prompt_tokens"]["max"] == 70  # tokens
    assert m["server_ttft_ms"]["n"] == 0  # OpenAI's stream carries no server times
    assert doc["finish_reasons"] == {"length": 2}
    missed = probe(*common, "--slo", "ttft_ms=0.001", url=f"127.0.0.1:{server.port}")
    assert missed.returncode == 3 and "MISSED" in missed.stdout, missed.stderr
    unauthorized = probe("--api", "openai", "--requests", "1", url=f"127.0.0.1:{server.port}")
    assert unauthorized.returncode == 2 and "401" in unauthorized.stderr
    too_short = probe(*common[:6], "--isl", "3", "--token-file", str(token_file), url=f"127.0.0.1:{server.port}")
    assert too_short.returncode == 2 and "--isl 3" in too_short.stderr  # the template alone is longer
