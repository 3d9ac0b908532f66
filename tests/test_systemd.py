"""The systemd unit and env file: what `appliance service` writes, `systemd-analyze verify` with no unknown
key, a security exposure of at most 5.0, the notify datagrams (plain and abstract sockets), the load
watch, the watchdog logic, and the NVML gauges (with a fake NVML: present with a GPU, absent without)."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from server import notify, service
from server.gpu import GpuSampler
from tests.server_harness import ROOT, Datagrams, child_env

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze missing (scripts/setup-venv.sh installs it)")


def test_the_repository_files_are_the_rendered_defaults():
    unit, env = service.render()
    assert (ROOT / "systemd" / "decode-appliance.service").read_text() == unit
    assert (ROOT / "systemd" / "decode-appliance.env").read_text() == env


def test_the_unit_has_notify_watchdog_bounded_restarts_a_user_and_gpu_friendly_hardening():
    unit, env = service.render()
    keys = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            keys.setdefault(k, []).append(v)
    assert keys["Type"] == ["notify"] and keys["WatchdogSec"] and keys["Restart"] == ["on-failure"]
    assert keys["StartLimitBurst"] and keys["RestartSec"] and keys["User"] == ["decode-appliance"]
    assert keys["EnvironmentFile"] == ["/etc/decode-appliance/decode-appliance.env"]
    assert "MemoryDenyWriteExecute" not in keys and keys["PrivateDevices"] == ["false"]
    assert "char-nvidia* rw" in keys["DeviceAllow"] and "/dev/nvidiactl rw" in keys["DeviceAllow"]
    assert "APPLIANCE_PORT=8765" in env and "APPLIANCE_DEVICES=0,1,2,3" in env


def _install(tmp_path):
    r = CliRunner().invoke(__import__("appliance.cli", fromlist=["main"]).main,
                           ["service", "install", "--prefix", str(tmp_path), "--user", "decode-test"])
    assert r.exit_code == 0, r.output
    return r, tmp_path / "etc/systemd/system/decode-appliance.service"


def test_service_install_writes_the_unit_and_env_file_and_prints_the_systemctl_commands(tmp_path):
    r, unit_path = _install(tmp_path)
    env_path = tmp_path / "etc/decode-appliance/decode-appliance.env"
    unit = unit_path.read_text()
    exec_start = re.search(r"^ExecStart=(\S+) serve$", unit, re.M).group(1)
    assert os.access(exec_start, os.X_OK)
    assert f"EnvironmentFile={env_path}" in unit and "User=decode-test" in unit
    assert env_path.read_text() == service.render()[1]
    assert "systemctl daemon-reload" in r.output and "systemctl enable --now decode-appliance" in r.output
    assert "useradd --system" in r.output and f"systemctl link {unit_path}" in r.output
    env_path.write_text("APPLIANCE_PORT=9000\n")
    _install(tmp_path)
    assert env_path.read_text() == "APPLIANCE_PORT=9000\n"  # the site's settings survive a reinstall


def test_service_print_shows_both_files():
    from appliance.cli import main

    r = CliRunner().invoke(main, ["service", "print"])
    assert r.exit_code == 0 and "Type=notify" in r.output and "APPLIANCE_HOST=127.0.0.1" in r.output


@needs_analyze
def test_systemd_analyze_verify_passes_without_unknown_keys(tmp_path):
    _, unit_path = _install(tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
    output = r.stdout + r.stderr
    assert "Unknown key" not in output and "Unknown section" not in output, output
    assert r.returncode == 0, output


@needs_analyze
def test_systemd_analyze_security_scores_the_unit_at_most_5(tmp_path):
    _, unit_path = _install(tmp_path)
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit_path)], capture_output=True,
                       text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 5.0, r.stdout


# --- notify ------------------------------------------------------------------------------------------


def test_notify_sends_one_datagram_to_a_path_socket_and_to_the_abstract_namespace(tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        assert notify.notify("READY=1", "STATUS=ready", env={"NOTIFY_SOCKET": str(path)})
        assert s.recv(4096) == b"READY=1\nSTATUS=ready"
    d = Datagrams()
    try:
        assert notify.notify("WATCHDOG=1", env={"NOTIFY_SOCKET": d.name})
        time.sleep(0.2)
        assert d.lines() == ["WATCHDOG=1"]
    finally:
        d.close()
    assert not notify.notify("READY=1", env={})
    assert not notify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "nobody")})


def test_the_watchdog_interval_is_for_this_pid_only():
    pid = str(os.getpid())
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 30.0
    assert notify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert notify.watchdog_interval_s({}) is None


def test_the_watchdog_pings_only_while_the_heartbeat_is_fresh():
    dog = notify.Watchdog(30.0)
    assert dog.period_s == 10.0
    assert dog.tick(heartbeat=100.0, now=110.0) == ["WATCHDOG=1"]
    stalled = dog.tick(heartbeat=100.0, now=116.0)
    assert "WATCHDOG=1" not in stalled and stalled[0].startswith("STATUS=engine stalled")


def test_the_load_watch_extends_the_start_timeout_only_while_the_load_progresses():
    sent, progress = [], iter([0, 1, 2, 2, 2, 2, 2, 2, 2, 2])
    watch = notify.LoadWatch(period_s=0.05, send=lambda *lines: sent.append(lines),
                             progress=lambda: next(progress, 2), watchdog=True).start()
    watch.update("loading weights")
    time.sleep(0.5)
    watch.stop()
    assert sent[0] == ("STATUS=starting",)
    assert sent[1] == ("STATUS=loading weights", "EXTEND_TIMEOUT_USEC=150000")
    periodic = sent[2:]
    extended = [s for s in periodic if any(x.startswith("EXTEND_TIMEOUT_USEC") for x in s)]
    assert len(extended) == 2 and all("WATCHDOG=1" in s for s in extended)
    assert periodic[-1][0].startswith("STATUS=loading weights (no progress for")


def test_the_process_progress_grows_with_cpu_work():
    before = notify.process_progress()
    sum(i * i for i in range(200000))
    assert notify.process_progress() > before


# --- NVML gauges ---------------------------------------------------------------------------------------


class FakeNvml(SimpleNamespace):
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, count):
        super().__init__(count=count)

    def nvmlInit(self):
        if self.count is None:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetClockInfo(self, h, which):
        return 1980 if which == 1 else 2619

    def nvmlDeviceGetPowerUsage(self, h):
        return 412_500  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return 9_000_000  # mJ

    def nvmlDeviceGetTemperature(self, h, which):
        return 61

    def nvmlDeviceGetFieldValues(self, h, ids):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # no memory temperature on this board

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=123 * 2**30)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 | 0x1


def test_gpu_gauges_are_sampled_from_nvml_and_a_missing_reading_is_left_out():
    registry = CollectorRegistry()
    sampler = GpuSampler(registry, interval_s=0.05, nvml=FakeNvml(2))
    assert sampler.start()
    time.sleep(0.15)
    sampler.stop()
    text = generate_latest(registry).decode()
    for line in ('decode_gpu_sm_clock_hz{gpu="1"} 1.98e+09', 'decode_gpu_power_watts{gpu="0"} 412.5',
                 'decode_gpu_energy_joules{gpu="0"} 9000.0', 'decode_gpu_temperature_celsius{gpu="1"} 61.0',
                 'decode_gpu_memory_used_bytes{gpu="0"} 1.32070244352e+11',
                 'decode_gpu_clock_event_active{gpu="0",reason="sw_power_cap"} 1.0',
                 'decode_gpu_clock_event_active{gpu="0",reason="hw_slowdown"} 0.0'):
        assert line in text, line
    assert "decode_gpu_memory_clock_hz" in text
    assert 'decode_gpu_memory_temperature_celsius{gpu=' not in text


@pytest.mark.parametrize("nvml", [None, FakeNvml(None), FakeNvml(0)], ids=["no-module", "no-driver", "no-gpu"])
def test_without_a_gpu_no_gpu_series_exist(nvml):
    registry = CollectorRegistry()
    sampler = GpuSampler(registry, nvml=nvml)
    if nvml is None:
        sampler.nvml = None
    assert not sampler.start()
    assert "decode_gpu_" not in generate_latest(registry).decode()


def test_appliance_serve_refuses_bad_options_with_one_line_whether_given_as_flags_or_env_file_variables(tmp_path):
    cases = [(["--port", "70000"], {}, "--port 70000"), (["--chunk", "0"], {}, "--chunk 0"),
             (["--keepalive", "3"], {}, "at least every 2 s"), (["--model", str(tmp_path / "no")], {}, "no such"),
             (["--token-file", str(tmp_path / "none")], {}, "--token-file"),
             ([], {"APPLIANCE_CHUNK": "0"}, "--chunk 0"), ([], {"APPLIANCE_MODEL": str(tmp_path / "no")}, "no such")]
    for args, env, text in cases:
        r = subprocess.run([sys.executable, "-m", "appliance", "serve", *args], capture_output=True, text=True,
                           cwd=ROOT, env=child_env(**env), timeout=60)
        assert r.returncode == 2 and text in r.stderr and r.stderr.count("\n") == 1, (args, env, r.stderr)
