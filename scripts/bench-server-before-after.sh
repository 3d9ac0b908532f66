#!/bin/bash
# The websocket path before (main at efb72b1: the `websockets` library) and after (aiohttp) side by side, and
# the OpenAI API beside it: same machine, same run (BENCHMARKS.md, Server). Run from the repository root.
set -u
rm -rf /tmp/before && mkdir -p /tmp/before && git archive efb72b1 | tar -x -C /tmp/before
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
export OMP_NUM_THREADS=1
(cd /tmp/before && PYTHONPATH=/tmp/before exec $PY -m appliance serve --port 18801 > /tmp/before.log 2>&1) &
OLD=$!
PYTHONPATH=$ROOT $PY -m appliance serve --port 18802 > /tmp/after.log 2>&1 &
NEW=$!
for p in 18801 18802; do for i in $(seq 120); do curl -sf localhost:$p/readyz >/dev/null && break; sleep 1; done; done
A="--requests 20 --warmup 3 --isl 32 --osl 16"
for round in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before $PY -m appliance probe 127.0.0.1:18801 $A --json /tmp/bench-before-ws-$round.json > /tmp/bench-before-ws-$round.txt 2>/dev/null)
  $PY -m appliance probe 127.0.0.1:18802 $A --json /tmp/bench-after-ws-$round.json > /tmp/bench-after-ws-$round.txt 2>/dev/null
  $PY -m appliance probe --api openai 127.0.0.1:18802 $A --json /tmp/bench-after-openai-$round.json > /tmp/bench-after-openai-$round.txt 2>/dev/null
done
kill $OLD $NEW
echo finished
