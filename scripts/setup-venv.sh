#!/usr/bin/env bash
# Build .venv for `make run` / `make test` on a fresh machine.
# - A machine with a working NVIDIA driver and a CUDA torch already installed system-wide keeps that torch
#   (venv with --system-site-packages): we never download a multi-GB CUDA build.
# - Any other machine gets the CPU torch 2.13.0 from the local wheel (pip's find-links).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

has_cuda_torch() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
        "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

if has_cuda_torch; then
    echo "setup: CUDA torch found system-wide; the venv reuses it"
    "$python" -m venv --system-site-packages "$venv"
else
    "$python" -m venv "$venv"
    echo "setup: installing CPU torch 2.13.0 from the local wheel"
    "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e '.[test]'

# systemd-analyze checks the unit file in the tests; install it where it is missing.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "setup: installing systemd (for systemd-analyze)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    else
        echo "setup: systemd-analyze missing and cannot be installed here; its tests will fail" >&2
    fi
fi
