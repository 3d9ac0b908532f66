"""The systemd unit and its environment file (`appliance service print|install`).

The files in the repository's `systemd/` directory are these templates rendered with the defaults
(a test keeps them equal); `install` renders them with this installation's executable and user.
"""

import os
import shutil
import sys
from pathlib import Path

from appliance.errors import ApplianceError

NAME = "decode-appliance"
DEFAULT_EXEC = "/opt/decode-appliance/.venv/bin/appliance"
DEFAULT_USER = "decode-appliance"

UNIT = """\
# decode-appliance: one user, lowest latency, the whole box. `appliance service install` writes this file
# with this installation's paths; `systemctl edit decode-appliance` overrides it without editing it.
[Unit]
Description=decode-appliance: single-user lowest-latency decode server (websocket decode.v1)
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
# Bounded restarts: at most 5 starts in 10 minutes, then the unit stays failed for a person to look at.
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
# READY=1 is sent when /readyz turns ready (weights loaded, graphs captured, one warm-up generation done).
Type=notify
NotifyAccess=main
EnvironmentFile={env_file}
ExecStart={exec_start} serve
User={user}
Group={user}
# Restart on crashes and watchdog kills, 5 s apart (systemd >= 254 can add RestartSteps=/RestartMaxDelaySec=
# for an exponential backoff; systemd 252 does not know them).
Restart=on-failure
RestartSec=5s
# A load that keeps making progress extends this with EXTEND_TIMEOUT_USEC; a stalled one is killed.
TimeoutStartSec=300s
# SIGTERM: stop accepting, finish or cancel the running request, close with 1012, exit 0.
TimeoutStopSec=60s
# WATCHDOG=1 follows the engine heartbeat: a hung device stops the pings and systemd restarts us.
WatchdogSec=30s
StateDirectory=decode-appliance
CacheDirectory=decode-appliance
LimitMEMLOCK=infinity
LimitNOFILE=65536
# A token for bearer auth without putting it in the environment file: the server reads
# $CREDENTIALS_DIRECTORY/token when --token-file is not given.
#LoadCredential=token:/etc/decode-appliance/token

# Hardening that keeps the GPUs reachable: no MemoryDenyWriteExecute= (CUDA and Triton JIT-compile into
# executable memory), PrivateDevices=false (it would hide /dev/nvidia*), and a closed device policy that
# lists the NVIDIA character devices (/dev/nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps, nvswitch).
# The nvidia and nvidia_uvm modules must be loaded at boot (ProtectKernelModules= forbids loading them).
PrivateDevices=false
DevicePolicy=closed
DeviceAllow=char-nvidia* rw
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome={protect_home}
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RemoveIPC=yes
KeyringMode=private
UMask=0077
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @obsolete @debug @mount @reboot @swap @cpu-emulation @clock @module @raw-io
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""

ENV = """\
# decode-appliance: options of `appliance serve`, read by systemd (EnvironmentFile=). Each APPLIANCE_*
# variable is the environment form of the option of the same name (`appliance serve --help`).

# Model directory (config.json + *.safetensors); unset: the embedded tiny test model.
#APPLIANCE_MODEL=/srv/models/DeepSeek-V4.1-Flash
APPLIANCE_HOST=127.0.0.1
APPLIANCE_PORT=8765
# The GPUs, one rank each: 0,1,2,3 is the box released V4.1-Flash needs (~307 GB of weights: four B300s,
# graphs on); cuda: one GPU, for a model that fits one (`appliance info --model DIR --devices 1
# --gpu-memory 288GB` says whether it does).
APPLIANCE_DEVICES={devices}
# Speculative drafting: none, dspark, mtp, adaptive or auto.
APPLIANCE_DRAFT=none
# reject: a second user gets busy + close 1013; queue: it waits in line (queued{{position}}).
APPLIANCE_ON_BUSY=reject
# Bearer token file (one line; chmod 600, owned by the service user). Unset: no auth, loopback only!
#APPLIANCE_TOKEN_FILE=/etc/decode-appliance/token
# With a token, /metrics asks for it too; false: /metrics stays open (a scraper without the token).
#APPLIANCE_METRICS_AUTH=true
# Browser origins allowed to connect (space separated).
#APPLIANCE_ORIGIN=https://chat.example.com
#APPLIANCE_CONTEXT=131072
#APPLIANCE_CHUNK=2048

# Compiled-kernel caches in the service's own writable directories (ProtectSystem=strict).
HOME=/var/lib/decode-appliance
TRITON_CACHE_DIR=/var/cache/decode-appliance/triton
PYTHONUNBUFFERED=1
"""


def render(exec_start: str = DEFAULT_EXEC, user: str = DEFAULT_USER, prefix: str = "/",
           devices: str = "0,1,2,3") -> tuple[str, str]:
    """(unit text, env text). `prefix` is where both files live (`/` for a real install)."""
    env_file = Path(prefix) / "etc" / NAME / f"{NAME}.env"
    # ProtectHome=yes hides /home, /root and /run/user: an installation under them needs read-only.
    under_home = any(str(exec_start).startswith(p) for p in ("/home/", "/root/", "/run/user/"))
    unit = UNIT.format(exec_start=exec_start, user=user, env_file=env_file,
                       protect_home="read-only" if under_home else "yes")
    return unit, ENV.format(devices=devices)


def paths(prefix: str = "/") -> tuple[Path, Path]:
    root = Path(prefix)
    return root / "etc" / "systemd" / "system" / f"{NAME}.service", root / "etc" / NAME / f"{NAME}.env"


def this_executable() -> str:
    """The `appliance` command of this installation (the venv's console script)."""
    here = Path(sys.executable).with_name("appliance")
    if here.exists():
        return str(here)
    found = shutil.which("appliance")
    if found:
        return str(Path(found).resolve())
    raise ApplianceError("cannot find the `appliance` executable of this installation: install the package "
                         "(pip install -e .) and run this command from its environment", field="exec")


def install(prefix: str = "/", user: str = DEFAULT_USER, devices: str = "0,1,2,3") -> tuple[Path, Path, list[str]]:
    """Write the unit and the env file (keeping an existing env file: it holds the site's settings).
    Returns both paths and the commands that finish the installation."""
    unit_text, env_text = render(this_executable(), user, prefix, devices)
    unit_path, env_path = paths(prefix)
    try:
        unit_path.parent.mkdir(parents=True, exist_ok=True)
        env_path.parent.mkdir(parents=True, exist_ok=True)
        unit_path.write_text(unit_text)
        if not env_path.exists():
            env_path.write_text(env_text)
            os.chmod(env_path, 0o640)
    except PermissionError as e:
        raise ApplianceError(f"{e.filename}: permission denied; run with sudo, or pass --prefix DIR",
                             field="prefix") from None
    commands = [f"sudo useradd --system --home-dir /var/lib/{NAME} --shell /usr/sbin/nologin {user}"]
    if Path(prefix).resolve() != Path("/"):
        commands.append(f"sudo systemctl link {unit_path}")
    commands += ["sudo systemctl daemon-reload", f"sudo systemctl enable --now {NAME}",
                 f"systemctl status {NAME}", f"journalctl -u {NAME} -f"]
    return unit_path, env_path, commands
