"""`appliance info` for the released configs: decode-state bytes per token in the packed formats and the
weight budget, computed from config.json alone."""

import json
import shutil
import subprocess
import sys

from .conftest import DATA


def info(tmp_path, name):
    shutil.copy(DATA / name, tmp_path / "config.json")
    p = subprocess.run([sys.executable, "-m", "appliance", "info", "--model", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_v41_flash_state_is_890_bytes_per_token_and_weights_match_the_release(tmp_path):
    r = info(tmp_path, "deepseek-v41-flash-config.json")
    assert r["state"]["per_token_packed"] == 890.0  # 3 x (288 + 68) / 2 + (288 + 68)
    w = r["weights"]
    parts = {k: v / 1e9 for k, v in w["by_part"].items()}
    assert abs(parts["routed experts"] - 288.8) < 0.5 and abs(parts["engram"] - 203.1) < 0.5
    assert abs(parts["drafter"] - 7.9) < 0.3 and abs(w["total"] / 1e9 - 510.3) < 2.0  # index total_size 510.3 GB
    assert 200e9 < w["by_where"]["host"] < w["by_part"]["engram"]  # the Engram tables stay in host memory
    roles = {row["layer"]: row["mode"] for row in r["layers"]}
    assert roles[2] == "full" and roles[20].startswith("full") and roles[24] == "reindex" and roles[25] == "reuse"


def test_v4_flash_state_is_about_3_5_kb_per_token(tmp_path):
    r = info(tmp_path, "deepseek-v4-flash-config.json")
    assert 3400 < r["state"]["per_token_packed"] < 3600
    assert r["layers"][2]["mode"] == "csa" and r["layers"][3]["mode"] == "hca" and r["layers"][0]["hash_moe"]
