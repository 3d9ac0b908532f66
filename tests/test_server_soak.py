"""Soak: 300 sequential short requests, each on its own connection, against a server in a subprocess. The
server's resident memory may grow by less than 5% from request 50 (after allocator and caches settle) to
request 300: a per-request or per-connection leak would show as steady growth. Every request files its
conversation in the prefix cache, so the cache gets a budget it fills within the first 50 requests: from
then on it evicts as much as it files, and a leak in it shows too."""

import time

import pytest

from tests.server_harness import ServerProcess, generate, open_ws, recv


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--chunk", "8", "--prefix-cache-gb", "0.004")
    yield s
    assert s.stop() == 0


def test_300_sequential_short_requests_grow_the_server_rss_by_less_than_5_percent(server):
    rss = {}
    for i in range(300):
        with open_ws(server, token=None) as ws:
            assert recv(ws)["state"] == "ready"
            ids = [(i * 7 + k) % 500 + 8 for k in range(4)]
            frames = generate(ws, f"soak-{i}", ids, 2, timings="final" if i % 2 else "per_token")
        assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 2, frames[-1]
        if i + 1 in (50, 300):
            rss[i + 1] = server.rss_bytes()
    growth = (rss[300] - rss[50]) / rss[50]
    report = f"RSS {rss[50] / 2**20:.1f} MiB at 50 -> {rss[300] / 2**20:.1f} MiB at 300 ({growth:+.2%})"
    print(report)
    assert growth < 0.05, report
    body = server.http("/metrics")[1]
    assert 'decode_requests_total{finish_reason="length"} 300.0' in body
    for _ in range(50):  # the last handler returns just after its client saw the close
        if "decode_connections 0.0" in body:
            break
        time.sleep(0.1)
        body = server.http("/metrics")[1]
    assert "decode_connections 0.0" in body
