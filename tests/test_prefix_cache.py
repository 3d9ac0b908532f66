"""Rewinds to any position and the prefix cache give back exactly the state a fresh prefill computes.

The expensive part of "equals a fresh prefill" is the fresh prefill, so the 4K-token test runs one prefill
pass and records what it wrote: every ring row by position (a ring row is a function of its position's
prefix only) and the logits of every position; the compressed rows of any prefix are the first rows of
the final state. A restore to p must then give the rings' reachable rows of positions below p, the rows
and ids below p, and, prefilling position p, its logits, bitwise on the reference path."""

import random

import pytest
import torch

from appliance.api import Done, Request, Started, Tokens
from appliance.decode.loop import RequestLoop
from appliance.decode.prefix_cache import PrefixCache
from appliance.decode.session import DecodeSession
from appliance.model.step import Output
from appliance.options import RunOptions

from .conftest import load


@pytest.fixture(scope="module")
def lm():
    return load(None, draft="auto")  # the embedded V4.1 model with its DSpark drafter, reference path


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(8, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def session(lm, capacity=1024, check=False, **options) -> DecodeSession:
    options.setdefault("chunk", 64)
    return DecodeSession(lm, RunOptions(**options), capacity=capacity, check_graph_inputs=check)


def record(s: DecodeSession, ids: list[int]):
    """Prefill `ids` once, recording each ring's row per position and the logits of every position. A ring
    written through `write` (the drafter's) is recorded there; one the fused kernels write in place is read
    after each forward (a call of at most the ring's size leaves all its rows there)."""
    n = len(ids)
    rings = {name: torch.zeros(n, r.data.shape[1], dtype=r.data.dtype) for name, r in s.state.rings.items()}
    logits = torch.zeros(n, s.cfg.vocab_size)
    written = set()  # the rings written through `write`
    hooks = []
    for name, ring in s.state.rings.items():
        def write(positions, values, ring=ring, name=name, orig=ring.write):
            rings[name][positions] = values.to(ring.data.dtype)
            written.add(name)
            return orig(positions, values)
        ring.write = write
        hooks.append(ring)
    model, forward = s.model, s.model.forward

    def spy(tokens, state, logits="all", **kw):
        out = forward(tokens, state, logits="all", **kw)
        if state is s.state:
            positions = torch.arange(state.length - tokens.numel(), state.length)
            logits_all[positions] = out.logits
            for name, ring in state.rings.items():
                if name in written:  # recorded by its writes (rows read before its first write are rewritten)
                    continue
                assert positions.numel() <= ring.size, f"a call of {positions.numel()} outgrows ring {name}"
                rings[name][positions] = ring.data[positions % ring.size]
        return Output(out.logits[-1:] if logits == "last" else out.logits, out.step, out.streams)

    logits_all = logits
    model.forward = spy
    try:
        s.prefill_all(ids)
    finally:
        del model.forward
        for ring in hooks:
            del ring.write
    return rings, logits


def test_a_rewind_to_1000_random_positions_of_a_4k_state_equals_a_fresh_prefill(lm):
    # spare = stride = 128: every position lies within a ring's spare of a checkpoint, so a restore needs no
    # prefill and 1000 of them cost copies only; the prefilling path is checked at a few positions below.
    # Chunks of 512: three of every four checkpoints are taken inside a chunk (state.RingTaps)
    n = 4096
    s = DecodeSession(lm, RunOptions(chunk=512, checkpoint_stride=128), capacity=n, spare=128)
    ids = ids_of(n, 0)
    rings, logits = record(s, ids)
    s.finish()  # into the host tier: positions past a rewind come back from there
    final = {k: v.clone() for k, v in s.state.live_buffers().items()}
    addresses = {k: v.data_ptr() for k, v in s.state.buffers().items()}
    positions = random.Random(0).sample(range(1, n), 1000)
    sampled = set(positions[::50])
    sources = set()
    for p in positions:
        cached = s.prepare(ids[:p + 1])
        assert cached == p, (p, cached, s.timeline.last)
        sources.add(s.timeline.last["source"])
        live = s.state.live_buffers()
        assert torch.equal(live["tokens"], torch.tensor(ids[:p]))
        for name, r in s.state.rings.items():
            want = rings[name][max(0, p - r.reach): p]
            assert torch.equal(live[f"ring.{name}"], want), f"ring {name} after a rewind to {p}"
        for name, r in s.state.rows.items():
            got = s.state.rows[name].data
            assert torch.equal(got[: p // r.ratio], final[f"rows.{name}"][: p // r.ratio]), f"rows {name} at {p}"
            assert not got[p // r.ratio: n // r.ratio].any(), f"rows {name} past {p} not cleared"
        if p in sampled:
            list(s.prefill(ids[:p + 1]))
            assert torch.equal(s.logits, logits[p]), f"logits at {p}"
    assert sources == {"device", "host"}  # both the live state and the host tier served rewinds
    assert {k: v.data_ptr() for k, v in s.state.buffers().items()} == addresses  # written in place
    # a stride of 1024 (the cache's other checkpoints dropped): restores land below the target and prefill
    # the rest, from the host tier (after a reset) and from the live state
    for node in s.timeline.cache.nodes():
        node.ckpts = {c: r for c, r in node.ckpts.items() if c % 1024 == 0}
    for p, fresh in ((3100, True), (2100, False), (1100, True)):
        if fresh:
            s.reset()
        landed = s.prepare(ids[:p + 1])
        assert landed == p // 1024 * 1024 < p and s.timeline.last["source"] == ("host" if fresh else "device")
        list(s.prefill(ids[:p + 1]))
        assert torch.equal(s.logits, logits[p]), f"logits at {p} after prefilling from {landed}"


def test_rewinds_of_a_v4_state_with_overlapping_compressors_and_its_mtp_drafter_equal_a_fresh_prefill(tiny_dirs):
    # V4's compressors pool overlapping groups (their carries reach two groups back) and its indexer has a
    # compressor of its own; the MTP drafter keeps its own ring. Every other checkpoint inside a chunk
    v4 = load(tiny_dirs["deepseek_v4"], draft="auto")
    n = 384
    s = DecodeSession(v4, RunOptions(draft="auto", chunk=64, checkpoint_stride=32), capacity=1024, spare=64)
    ids = ids_of(n, 7)
    rings, logits = record(s, ids)
    s.finish()
    final = {k: v.clone() for k, v in s.state.live_buffers().items()}
    positions = random.Random(1).sample(range(1, n), 200)
    for p in positions:
        assert s.prepare(ids[:p + 1]) == p
        live = s.state.live_buffers()
        for name, r in s.state.rings.items():
            assert torch.equal(live[f"ring.{name}"], rings[name][max(0, p - r.reach): p]), f"ring {name} at {p}"
        for name, r in s.state.rows.items():
            assert torch.equal(live[f"rows.{name}"], final[f"rows.{name}"][: p // r.ratio]), f"rows {name} at {p}"
    for p in positions[:2]:
        s.prepare(ids[:p + 1])
        list(s.prefill(ids[:p + 1]))
        assert torch.equal(s.logits, logits[p]), f"logits at {p}"
    # drafting from a restored state: the greedy continuation of a plain cold run
    p = 200
    _, got, _ = run(RequestLoop(s, v4.tokenizer), ids[:p])
    _, want, _ = run(RequestLoop(session(v4, prefix_cache_gb=0), v4.tokenizer), ids[:p])
    assert got == want


@pytest.mark.parametrize("draft", ["none", "dspark"])
def test_checkpoints_inside_a_chunk_equal_those_of_a_prefill_cut_there(lm, draft):
    """Chunks are not cut at the checkpoint stride: a checkpoint inside a chunk is made from the rings the
    chunk writes (the target's) and from the drafter observing the chunk up to it. Every checkpoint of a
    prompt prefilled in chunks of 96 (stride 16, most inside a chunk) equals, ring for ring and bit for bit,
    the one a prefill in chunks of 16 takes at the same position; and so do the logits."""
    ids = ids_of(random.randrange(150, 200), random.randrange(1 << 30))
    made = {}
    for chunk in (16, 96):
        s = DecodeSession(lm, RunOptions(draft=draft, chunk=chunk, checkpoint_stride=16, prefix_cache_gb=0),
                          capacity=256)
        ends = list(s.prefill(ids))
        assert ends == list(range(chunk, len(ids), chunk)) + [len(ids)]  # no chunk cut at a checkpoint
        made[chunk] = s.timeline.ckpts, s.logits
    (cut, cut_logits), (whole, whole_logits) = made[16], made[96]
    assert sorted(whole) == sorted(cut) == sorted({*range(16, len(ids), 16), len(ids)})
    assert any(name.startswith("draft.") for name in whole[16].rings) == (draft == "dspark")
    for c in cut:
        for name, ring in cut[c].rings.items():
            assert torch.equal(whole[c].rings[name], ring), f"ring {name} of the checkpoint at {c}"
    assert torch.equal(whole_logits, cut_logits)


def run(loop, ids, n=8, rid="r"):
    events = list(loop.run(Request(id=rid, input_ids=ids, max_tokens=n, ignore_eos=True)))
    assert isinstance(events[0], Started) and isinstance(events[-1], Done), events[-1]
    return events[0].cached_tokens, [i for e in events if isinstance(e, Tokens) for i in e.ids], events[-1]


@pytest.mark.parametrize("draft", ["none", "dspark"])
def test_restores_from_host_and_disk_equal_fresh_prefills_with_and_without_drafting(lm, tmp_path, draft):
    opts = dict(draft=draft, chunk=32, checkpoint_stride=32, prefix_cache_dir=tmp_path)
    loop = RequestLoop(session(lm, check=True, **opts), lm.tokenizer)  # cycles check no buffer moved
    first = ids_of(100, 1)
    _, out1, _ = run(loop, first)
    run(loop, ids_of(24, 2))  # a side request replaces the live state
    turn2 = first + out1 + ids_of(12, 3)
    cold = RequestLoop(session(lm, draft=draft, chunk=32, prefix_cache_gb=0), lm.tokenizer)
    _, want, _ = run(cold, turn2)
    want_logits = cold.session.logits.clone()  # the prompt's last logits
    if draft != "none":  # the drafter's state at the end of the prompt
        cold.session.reset()
        cold.session.prefill_all(turn2)
        want_draft = {k: v.clone() for k, v in cold.session.spec.state.live_buffers().items() if k.startswith("ring.")}
    cached, got, done = run(loop, turn2)
    assert done.prefix_cache["source"] == "host" and cached >= len(first) + len(out1) - 16, done.prefix_cache
    assert got == want
    for s in (loop.session, session(lm, **opts)):  # the host tier, then a new session reading the disk
        s.reset()
        s.prefill_all(turn2)
        assert s.timeline.last["source"] == ("host" if s is loop.session else "disk"), s.timeline.last
        assert torch.equal(s.logits, want_logits)
        if draft != "none":  # the drafter's rings too (its ids are write-only and not compared)
            mine = s.spec.state.live_buffers()
            for name, want_rows in want_draft.items():
                assert torch.equal(mine[name], want_rows), name
    restarted = RequestLoop(session(lm, **opts), lm.tokenizer)
    cached, got, done = run(restarted, turn2)
    assert done.prefix_cache["source"] == "disk" and cached > len(first) and got == want


def test_a_corrupted_or_foreign_cache_file_is_reported_ignored_and_the_request_succeeds(lm, tmp_path):
    from appliance.decode.prefix_disk import SUFFIX

    opts = dict(chunk=32, checkpoint_stride=32, prefix_cache_dir=tmp_path)
    prompt = ids_of(100, 4)
    run(RequestLoop(session(lm, **opts), lm.tokenizer), prompt)
    [ours] = tmp_path.glob(f"*{SUFFIX}")
    # another numerics never uses the file, and leaves it alone
    plain = load(None, numerics="plain")
    heard = []
    other = DecodeSession(plain, RunOptions(numerics="plain", **opts), capacity=1024, notice=heard.append)
    cached, _, _ = run(RequestLoop(other, plain.tokenizer), prompt + [7])
    assert cached == 0 and any("made by another model or with other numerics" in m for m in heard), heard
    # a flipped byte in the data, and a file that is no cache file at all
    blob = bytearray(ours.read_bytes())
    blob[-100] ^= 0xFF
    ours.write_bytes(bytes(blob))
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a cache file")
    heard.clear()
    s = DecodeSession(lm, RunOptions(**opts), capacity=1024, notice=heard.append)
    cached, got, done = run(RequestLoop(s, lm.tokenizer), prompt + [7])
    assert len(got) == 8 and cached == 0 and done.prefix_cache["source"] == "none"  # it went through, cold
    assert any("junk.prefix: unreadable" in m and "removed" in m for m in heard), heard
    assert any("corrupted (checksum of" in m and "ignored and removed" in m for m in heard), heard
    assert not ours.exists() and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2  # plain's, the new one


def fake_insert(cache: PrefixCache, ids: list[int], width: int = 4):
    """Commit a conversation of `ids` with one row per position and no checkpoints, as a request's end does."""
    def rows_of(a, b):
        return {"kv": torch.zeros(b - a, width)}
    cache.clock += 1
    _, path, _ = cache.insert(torch.tensor(ids), rows_of, {})
    cache.evict(newest=path[-1])


def test_a_cache_over_its_budget_evicts_the_least_recently_used_conversation_first():
    per = 100 * (8 + 16)  # 100 ids + 100 rows of 4 floats
    cache = PrefixCache(int(3.5 * per), {"kv": 1})
    a, b, c = ([k] + list(range(100, 199)) for k in (1, 2, 3))
    for conv in (a, b, c):
        fake_insert(cache, conv)
    cache.clock += 1
    cache.touch(cache.match(torch.tensor(a)).path)  # a is used again: b is now the oldest
    fake_insert(cache, [4] + list(range(100, 199)))
    firsts = sorted(int(n.tokens[0]) for n in cache.root.children.values())
    assert firsts == [1, 3, 4] and cache.host_bytes <= cache.budget
    # a shared prefix is stored once: a branch of a costs only its own ids and rows
    before = cache.host_bytes
    fake_insert(cache, a[:60] + [9] * 5)
    assert cache.match(torch.tensor(a)).length == 100 and cache.host_bytes - before <= 5 * 24 + per // 4


def test_a_side_request_does_not_evict_the_main_conversation():
    main = [1] + list(range(100, 400))
    cache = PrefixCache(len(main) * 24 + 40 * 24, {"kv": 1})
    fake_insert(cache, main)
    side = [1] + list(range(100, 120)) + [7] * 60  # shares a 21-id prefix, 80 ids long: over the budget
    fake_insert(cache, side)
    assert cache.match(torch.tensor(main)).length == len(main)  # the main conversation stayed whole
    assert cache.match(torch.tensor(side)).length == 21 and cache.host_bytes <= cache.budget


def test_prefix_cache_metrics_count_hits_misses_bytes_and_restore_time():
    from server.metrics import Metrics

    m = Metrics()
    usage = {"prompt_tokens": 10, "completion_tokens": 1, "cached_tokens": 8}
    m.observe_end(Done("a", "length", usage, {}, None, prefix_cache={"source": "host", "cached_tokens": 8,
                                                        "restored_bytes": 4096, "restore_ms": 2.0}))
    m.observe_end(Done("b", "length", dict(usage, cached_tokens=0), {}, None,
                       prefix_cache={"source": "none", "cached_tokens": 0, "restored_bytes": 0, "restore_ms": 0.1}))
    text = m.exposition().decode()
    assert 'decode_prefix_cache_hits_total{tier="host"} 1.0' in text
    assert "decode_prefix_cache_misses_total 1.0" in text
    assert "decode_prefix_cache_restored_bytes_total 4096.0" in text
    assert "decode_prefix_cache_restore_seconds_count 2.0" in text


def test_a_restarted_server_with_a_cache_dir_resumes_a_conversation_with_its_prefix_cached(tmp_path):
    from tests.server_harness import ServerProcess, generate, metric, open_ws, prompt, recv, token_ids

    args = ("--chunk", "32", "--prefix-cache-dir", str(tmp_path / "cache"))
    first = prompt(301, 80)

    def talk(request_id, ids, n):
        server = ServerProcess(*args)
        try:
            with open_ws(server, token=None) as ws:
                assert recv(ws)["type"] == "hello"
                frames = generate(ws, request_id, ids, n)
            return frames, metric(server, 'decode_prefix_cache_hits_total{tier="disk"}')
        finally:
            assert server.stop() == 0

    frames, _ = talk("a", first, 8)
    out = token_ids(frames)
    frames, disk_hits = talk("b", first + out + [5, 6, 7], 4)
    started = next(f for f in frames if f["type"] == "started")
    done = next(f for f in frames if f["type"] == "done")
    # the first request's state held its prompt and all but its last token: all of it comes back
    assert started["cached_tokens"] == done["usage"]["cached_tokens"] == len(first) + len(out) - 1
    assert disk_hits == 1


def test_bench_agent_replays_a_trace_with_and_without_the_cache_and_reports_the_ideal(tmp_path):
    import json

    from click.testing import CliRunner

    from appliance.cli import main

    a = ids_of(60, 5)
    lines = [{"input_ids": a, "kind": "main"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
              "kind": "side", "max_tokens": 2},
             {"input_ids": a + ids_of(10, 6), "kind": "main"}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = CliRunner().invoke(main, ["bench", "agent", "--trace", str(trace), "--max-tokens", "3", "--chunk", "32",
                                  "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    rows, plain = out["requests"], out["no_reuse"]
    assert [x["kind"] for x in rows] == ["main", "side", "main"] and out["identical_outputs"]
    assert rows[2]["ideal_cached_tokens"] == 60 and rows[2]["cached_tokens"] == 60  # the request end's checkpoint
    assert plain[2]["cached_tokens"] == 0  # the side request replaced the only state
    assert out["summary"]["cache"]["cached_of_ideal"] == 1.0


def test_the_agent_conversation_keeps_tool_loop_reasoning_and_drops_the_side_chats():
    from appliance.chat import get_dialect
    from appliance.loader import default_model_dir
    from appliance.measure.agent import AgentConversation
    from appliance.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir())
    conv = AgentConversation(get_dialect("deepseek_v41"), tok, context=1500, side_every=2)
    seen = []
    for kind, ids in conv.requests(4):
        seen.append((kind, tok.decode(ids)))
        conv.heard(kind, f"thought-{len(seen)}")
    assert [k for k, _ in seen] == ["main", "main", "side", "main", "main", "side"]
    assert len(tok.encode(seen[0][1])) >= 1500 and "Repository map" in seen[0][1]
    assert "thought-1" in seen[1][1] and "thought-1" in seen[4][1]  # the tool loop keeps its reasoning
    assert "thought-3" not in seen[5][1] and "Step 2: parser." in seen[5][1]  # the side chat drops it
