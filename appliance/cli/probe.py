"""`appliance probe`: one user's latency measured against a running server, on the client: over decode.v1
(the default) or an OpenAI-compatible API's streaming chat completions (`--api openai`), so this box and
any other server are measured side by side by one tool."""

import sys
from pathlib import Path

import click

from appliance.errors import ApplianceError

from .common import check_range, friendly

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
OPENAI_URL = "http://127.0.0.1:8765"


def _normalize_url(url: str) -> str:
    if "://" not in url:
        url = f"ws://{url}"
    scheme, rest = url.split("://", 1)
    scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    if "/" not in rest:
        rest += "/v1/stream"
    return f"{scheme}://{rest}"


@click.command()
@click.argument("url", default=None, required=False)
@click.option("--api", type=click.Choice(["decode", "openai"]), default="decode", show_default=True,
              help="decode: decode.v1 over the websocket (URL default ws://127.0.0.1:8765/v1/stream); openai: "
                   "streaming chat completions of any OpenAI-compatible server (URL default http://127.0.0.1:8765, "
                   "the model the server's /v1/models lists first)")
@click.option("--requests", "n_requests", type=int, default=20, show_default=True, help="measured requests")
@click.option("--warmup", type=int, default=2, show_default=True, help="requests run first and not counted")
@click.option("--isl", type=int, default=None,
              help="prompt length in tokens (default 128): decode.v1 sends that many random ids; --api openai "
                   "calibrates random words until the server counts that many prompt tokens (chat template included)")
@click.option("--osl", type=int, default=None, help="output length, exact (ignore_eos; default 128)")
@click.option("--prompt-file", type=click.Path(path_type=Path), help="a text prompt instead of random ids")
@click.option("--token-file", type=click.Path(path_type=Path), envvar="APPLIANCE_TOKEN_FILE",
              help="bearer token file")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="summary + per-request JSON")
@click.option("--jsonl", "jsonl_path", type=click.Path(path_type=Path), help="one JSON line per request")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="one CSV row per request")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path),
              help="PNG: inter-token-gap histogram and per-request timeline (needs matplotlib)")
@click.option("--slo", default=None,
              help="e.g. ttft_ms=500,tpot_ms=40,p99_itl_ms=80 (bare name: every request; pNN_/mean_ prefix: "
                   "that statistic); exit 3 if one is missed")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random prompts")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds to wait for any frame")
@friendly
def probe(url, api, n_requests, warmup, isl, osl, prompt_file, token_file, json_path, jsonl_path, csv_path,
          plot_path, slo, seed, timeout):
    """Measure one user's latency against a running server, one request at a time: TTFT, time to second
    token, server TTFT and the overhead between (decode.v1 only), TPOT, tokens/s, every inter-token gap, e2e.

    Exit codes: 0 ok, 2 usage, 3 an SLO missed, 4 the box is busy or not ready, 5 unreachable."""
    import asyncio

    from server.probe import stats as probe_stats
    from server.probe.client import ProbeConfig, ProbeError, run_probe
    from server.probe.openai_client import run_openai_probe

    if prompt_file is not None and isl is not None:
        raise ApplianceError("give --isl (random ids) or --prompt-file, not both", field="isl")
    check_range("--requests", n_requests, 1)
    check_range("--warmup", warmup, 0)
    check_range("--isl", isl, 1)
    check_range("--osl", osl, 1)
    slos = probe_stats.parse_slo(slo) if slo else []
    if plot_path is not None:
        from server.probe.plot import _pyplot

        _pyplot()  # fail on a missing matplotlib before measuring, not after
    prompt = None
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text()
        except OSError as e:
            raise ApplianceError(f"--prompt-file {prompt_file}: {e.strerror}", field="prompt_file") from None
        if not prompt.strip():
            raise ApplianceError(f"--prompt-file {prompt_file}: is empty", field="prompt_file")
    from server.gate import read_token

    if api == "openai":
        url = url or OPENAI_URL
    else:
        url = _normalize_url(url or DEFAULT_URL)
    cfg = ProbeConfig(url=url, requests=n_requests, warmup=warmup,
                      isl=None if prompt is not None else (isl or 128), osl=osl or 128, prompt=prompt,
                      ignore_eos=prompt is None or osl is not None,
                      token=read_token(token_file) if token_file else None, seed=seed, timeout_s=timeout)
    total = warmup + n_requests
    try:
        runner = run_openai_probe if api == "openai" else run_probe
        run = asyncio.run(runner(cfg, on_request=lambda rec: _progress(rec, total)))
    except ProbeError as e:
        if sys.stderr.isatty():
            sys.stderr.write("\n")  # end the progress bar's line
        click.echo(f"appliance: error: {e.message}", err=True)
        sys.exit(e.exit_code)
    summary = probe_stats.summarize(run)
    results = probe_stats.check_slos(slos, summary)
    click.echo(probe_stats.table(run, summary))
    if json_path:
        probe_stats.write_json(json_path, run, summary, results)
    if jsonl_path:
        probe_stats.write_jsonl(jsonl_path, run)
    if csv_path:
        probe_stats.write_csv(csv_path, run)
    if plot_path:
        from server.probe.plot import plot

        plot(run, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    missed = [r for r in results if not r["ok"]]
    for r in results:
        value = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        click.echo(f"SLO {r['slo']}: {r['stat']} {r['metric']} = {value} (must be {r['rule']} {r['limit']:g}) "
                   f"{'ok' if r['ok'] else 'MISSED'}")
    if missed:
        sys.exit(3)


def _progress(rec, total: int) -> None:
    done = rec.index + 1
    what = "warm-up" if rec.warmup else "measured"
    ttft = f"ttft {rec.ttft_ms:.1f} ms" if rec.ttft_ms is not None else "no tokens"
    tpot = f", tpot {rec.tpot_ms:.2f} ms" if rec.tpot_ms is not None else ""
    if sys.stderr.isatty():
        width = 30
        fill = int(width * done / total)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what}: {ttft}{tpot}   ")
        if done == total:
            sys.stderr.write("\n")
    elif done == total or done % max(1, total // 10) == 0:
        sys.stderr.write(f"probe: {done}/{total} ({what}: {ttft}{tpot})\n")
    sys.stderr.flush()
