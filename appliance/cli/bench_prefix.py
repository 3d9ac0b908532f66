"""`appliance bench agent` and `appliance bench prefix`: prefix reuse measured on an agent's conversation,
and the costs of its parts. The measuring is appliance.measure.agent's and .prefix's; this module parses and
prints."""

import dataclasses
import json
import tempfile
from pathlib import Path

import click

from appliance.options import RunOptions

from .bench import _contexts
from .common import friendly, load, run_options

NO_REUSE = {"prefix_cache_gb": 0.0, "checkpoint_stride": 0, "prefix_cache_dir": None}  # main's reuse: 16 positions


@click.command("agent")
@run_options(leave_out=("context",))
@click.option("--turns", type=int, default=12, show_default=True, help="agent turns (tool calls) to replay")
@click.option("--context", "context", type=int, default=0, show_default=True,
              help="tokens the conversation starts at: the system prompt with its tools, padded with a repository "
                   "map (0: no padding, ~1.2K tokens on the embedded model)")
@click.option("--max-tokens", type=int, default=32, show_default=True,
              help="tokens generated per request (the turn's reasoning)")
@click.option("--side-every", type=int, default=4, show_default=True,
              help="a side request (a sub-agent sharing the system prompt) after every N turns (0: none)")
@click.option("--trace", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="replay this JSONL trace of requests instead (one {input_ids} or {messages, tools?, "
                   "thinking?} per line; optional max_tokens, kind)")
@click.option("--save-trace", type=click.Path(path_type=Path, dir_okay=False),
              help="write the requests sent as a JSONL trace (input_ids)")
@click.option("--json", "as_json", is_flag=True)
@friendly
def agent(options: RunOptions, turns, context, max_tokens, side_every, trace, save_trace, as_json):
    """Replay a multi-turn agent conversation through the Engine API twice in one run: with the prefix cache
    (these options) and without any reuse beyond the last 16 positions (--prefix-cache-gb 0
    --checkpoint-stride 0). Per request: prompt tokens, cached tokens, the ideal (the longest prefix an
    earlier request shares), prefill time and TTFT; the outputs of the two runs must be identical."""
    from appliance.chat import dialect_for_model
    from appliance.engine import Engine
    from appliance.measure import agent as ma

    engine = Engine.load(options)
    if engine is None:  # a follower rank: it ran rank 0's jobs, its command is done
        return
    cfg, tokenizer = engine.session.cfg, engine.loop.tokenizer
    dialect = dialect_for_model(cfg.family, getattr(cfg, "dspark", None) is not None)
    limit, notes = engine.info.max_context, []
    sent: list[tuple[str, list[int], int]] = []
    try:
        if trace is not None:
            sent = [(r["kind"], r["ids"], r["max_tokens"] or max_tokens) for r in ma.read_trace(trace, dialect,
                                                                                                    tokenizer)]
            rows = ma.replay(engine.generate, iter(sent))
        else:
            conv = ma.AgentConversation(dialect, tokenizer, context, side_every)

            def requests():
                for kind, ids in conv.requests(turns):
                    if len(ids) + max_tokens > limit:
                        notes.append(f"stopped at turn {conv.turn}: {len(ids)} prompt tokens + {max_tokens} exceed "
                                     f"the context limit {limit}")
                        return
                    sent.append((kind, ids, max_tokens))
                    yield kind, ids, max_tokens

            rows = ma.replay(engine.generate, requests(), conv.heard)
    finally:
        engine.close()
    if save_trace is not None:
        save_trace.write_text("".join(json.dumps({"kind": k, "max_tokens": n, "input_ids": ids}) + "\n"
                                      for k, ids, n in sent))
    baseline = Engine.load(dataclasses.replace(options, **NO_REUSE))
    try:
        rows_plain = ma.replay(baseline.generate, iter(sent))
    finally:
        baseline.close()
    identical = [r["output"] for r in rows] == [r["output"] for r in rows_plain]
    for r in rows + rows_plain:
        del r["output"]
    result = {"requests": rows, "no_reuse": rows_plain,
              "summary": {"cache": ma.summary(rows), "no_reuse": ma.summary(rows_plain)},
              "identical_outputs": identical, "notes": notes,
              "options": {"checkpoint_stride": options.checkpoint_stride, "prefix_cache_gb": options.prefix_cache_gb,
                          "context": context, "max_tokens": max_tokens, "side_every": side_every}}
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(f"{'req':>4} {'kind':<5}{'prompt':>7}{'ideal':>7}{'cached':>7}{'prefill ms':>11}{'TTFT ms':>9}"
               f"  |{'cached':>7}{'prefill ms':>11}{'TTFT ms':>9}   (left: prefix cache; right: no cache, "
               "the journal's 16 positions)")
    for a, b in zip(rows, rows_plain):
        click.echo(f"{a['request']:>4} {a['kind']:<5}{a['prompt_tokens']:>7}{a['ideal_cached_tokens']:>7}"
                   f"{a['cached_tokens']:>7}{a['prefill_ms']:>11.1f}{a['ttft_ms']:>9.1f}  |{b['cached_tokens']:>7}"
                   f"{b['prefill_ms']:>11.1f}{b['ttft_ms']:>9.1f}")
    for name, s in result["summary"].items():
        slope = s["late_ttft_ms_per_1k_prompt_tokens"]
        click.echo(f"{name}: cached {s['cached_tokens']} of an ideal {s['ideal_cached_tokens']} "
                   f"({s['cached_of_ideal']:.1%}); late main turns: TTFT {s['late_main_ttft_ms']:.1f} ms at "
                   f"{s['late_main_prompt_tokens']:.0f} prompt tokens ({s['late_main_prefilled_tokens']:.0f} "
                   f"prefilled), {'n/a' if slope is None else f'{slope:+.1f}'} ms per 1K more")
    click.echo(f"identical outputs: {identical}")
    for n in notes:
        click.echo(n)


@click.command("prefix")
@run_options(leave_out=("context", "draft_tokens", "no_graphs"))
@click.option("--context", "contexts", default="4K", show_default=True,
              help="conversation length(s) in tokens, comma separated (1K = 1024)")
@click.option("--rewinds", type=int, default=20, show_default=True, help="rewinds to random positions")
@click.option("--json", "as_json", is_flag=True)
@friendly
def prefix(options: RunOptions, contexts, rewinds, as_json):
    """The costs of prefix reuse: a checkpoint (bytes, time), committing a conversation to the cache (host +
    disk), a rewind of the live state to a random position (the restore, then the prefill from the
    checkpoint), and a whole conversation restored from host memory and from disk."""
    from appliance.decode.session import DecodeSession
    from appliance.measure.prefix import measure_prefix

    lm = load(options)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in _contexts(contexts):
            opts = dataclasses.replace(options, graphs=False, prefix_cache_dir=options.prefix_cache_dir or
                                       Path(tmp) / f"ctx{n}")
            rows.append(measure_prefix(lambda o=opts, n=n: DecodeSession(lm, o, capacity=n + 8), n, rewinds))
    if as_json:
        click.echo(json.dumps({"runs": rows}, indent=1))
        return
    for r in rows:
        c, w = r["checkpoint"], r["rewind"]
        click.echo(f"context {r['context']}, stride {r['stride']}: prefill {r['prefill_ms_per_token']:.2f} ms/token; "
                   f"checkpoint {c['bytes'] / 1e6:.2f} MB in {c['ms']:.2f} ms; commit {r['commit_ms']:.1f} ms")
        click.echo(f"  rewind x{w['n']}: restore {w['restore_ms']:.2f} ms + prefill of "
                   f"{w['prefilled_tokens_mean']:.0f} tokens on average ({w['prefill_ms_median']:.1f} ms median), "
                   f"worst {w['total_ms_max']:.1f} ms")
        for tier, t in r["restore"].items():
            click.echo(f"  restore {t['cached_tokens']} tokens from {tier} ({t['source']}): {t['bytes'] / 1e6:.2f} MB "
                       f"in {t['ms']:.2f} ms")
