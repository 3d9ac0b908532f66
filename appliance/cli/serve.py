"""`appliance serve`, `appliance probe`, `appliance service ...`: the websocket server, its latency probe and
its systemd unit. The `server` package is imported inside each command, never at module level, so the rest
of the CLI does not pay for (or depend on) websockets and prometheus."""

import errno
import os
import sys
from pathlib import Path

import click

from appliance.errors import ApplianceError

from .main import MODEL_HELP, friendly, main

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
DRAFTS = ["none", "dspark", "mtp", "adaptive", "auto"]


def _check_range(name: str, value, lo, hi=None, hint: str = "") -> None:
    if value is None:
        return
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ApplianceError(f"{name} {value}: must be {bound}{hint}", field=name.lstrip("-"), value=value)


def _token(token_file) -> str | None:
    from server.gate import read_token

    if token_file is not None:
        return read_token(token_file)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")  # systemd LoadCredential=token:...
    if creds and (Path(creds) / "token").is_file():
        return read_token(Path(creds) / "token")
    return None


# --- serve ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None, envvar="APPLIANCE_MODEL",
              help=MODEL_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="APPLIANCE_HOST", help="address to bind")
@click.option("--port", type=int, default=8765, show_default=True, envvar="APPLIANCE_PORT",
              help="port to bind (0: any free port, printed on stderr)")
@click.option("--token-file", type=click.Path(path_type=Path), envvar="APPLIANCE_TOKEN_FILE",
              help="file holding the bearer token; without it (and without a systemd credential `token`) "
                   "auth is off")
@click.option("--metrics-auth/--no-metrics-auth", default=True, show_default=True, envvar="APPLIANCE_METRICS_AUTH",
              help="with a token, /metrics asks for it too (Prometheus: `authorization: {credentials_file: ...}`); "
                   "--no-metrics-auth leaves /metrics open for a scraper that cannot send it (/healthz and "
                   "/readyz are always open)")
@click.option("--origin", "origins", multiple=True, envvar="APPLIANCE_ORIGIN",
              help="browser origin allowed to connect (repeatable; `*` for any); none: browsers are refused")
@click.option("--on-busy", type=click.Choice(["reject", "queue"]), default="reject", show_default=True,
              envvar="APPLIANCE_ON_BUSY", help="a second user: refuse (busy, close 1013) or queue it")
@click.option("--draft", type=click.Choice(DRAFTS), default="none", show_default=True, envvar="APPLIANCE_DRAFT",
              help="speculative drafting")
@click.option("--numerics", type=click.Choice(["official", "plain"]), default="official", show_default=True,
              envvar="APPLIANCE_NUMERICS", help="official: the official code's activation/KV quantization")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              envvar="APPLIANCE_DTYPE", help="activation dtype")
@click.option("--path", "op_path", type=click.Choice(["auto", "reference", "fast"]), default="auto",
              show_default=True, envvar="APPLIANCE_PATH",
              help="reference: plain torch ops; fast: Triton kernels; auto: fast on CUDA, reference on CPU")
@click.option("--devices", default="cpu", show_default=True, envvar="APPLIANCE_DEVICES",
              help="where the engine runs (cpu, cuda)")
@click.option("--draft-tokens", type=int, default=3, show_default=True, envvar="APPLIANCE_DRAFT_TOKENS",
              help="drafts per cycle (1..5 with DSpark)")
@click.option("--no-graphs", is_flag=True, envvar="APPLIANCE_NO_GRAPHS",
              help="run the decode cycle eagerly on CUDA instead of replaying captured CUDA graphs")
@click.option("--chunk", type=int, default=256, show_default=True, envvar="APPLIANCE_CHUNK",
              help="prefill chunk size (cancel and progress act between chunks)")
@click.option("--context", type=int, default=None, envvar="APPLIANCE_CONTEXT",
              help="context limit in tokens (default: the model's, capped by memory)")
@click.option("--idle-timeout", type=float, default=300.0, show_default=True, envvar="APPLIANCE_IDLE_TIMEOUT",
              help="seconds a connection may hold the box without sending anything (0: forever); then close 4408")
@click.option("--drain", type=float, default=5.0, show_default=True, envvar="APPLIANCE_DRAIN",
              help="on SIGTERM, seconds the running request may finish before it is cancelled (the process exits "
                   "at most 15 s after that, whatever its connections do)")
@click.option("--keepalive", type=float, default=1.0, show_default=True,
              help="seconds without a frame during a prefill before the server sends a progress keepalive")
@friendly
def serve(model_dir, host, port, token_file, metrics_auth, origins, on_busy, draft, numerics, dtype, op_path, devices,
          draft_tokens, no_graphs, chunk, context, idle_timeout, drain, keepalive):
    """Serve the model over websocket (protocol decode.v1, ws://HOST:PORT/v1/stream) with /healthz, /readyz
    and /metrics on the same port. One user at a time. SIGTERM drains and exits 0.

    Every option can also come from the environment variable APPLIANCE_<OPTION> (the systemd env file)."""
    from appliance.parallel.world import start
    from server.app import ServerConfig, run

    world = start(devices)
    if not world.main:  # ranks 1..n-1 of a split model: no server, they follow rank 0's requests
        from appliance.engine import Engine

        Engine.load(model_dir, devices=devices, draft=draft, draft_tokens=draft_tokens, numerics=numerics,
                    dtype=dtype, path=op_path, chunk=chunk, context=context, graphs=not no_graphs)
        return
    if model_dir is not None and not Path(model_dir).is_dir():
        raise ApplianceError(f"--model {model_dir}: no such directory", field="model")
    _check_range("--port", port, 0, 65535)
    _check_range("--chunk", chunk, 1)
    _check_range("--context", context, 2)
    _check_range("--keepalive", keepalive, 0.05, 2.0, " (decode.v1 promises a frame at least every 2 s)")
    _check_range("--idle-timeout", idle_timeout, 0)
    _check_range("--drain", drain, 0)
    token = _token(token_file)
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"appliance: warning: serving on {host} without a token: anyone who reaches the port can "
                   f"use the box (--token-file)", err=True)
    config = ServerConfig(host=host, port=port, token=token, origins=tuple(origins), on_busy=on_busy,
                          idle_timeout_s=idle_timeout, keepalive_s=keepalive, drain_s=drain, metrics_auth=metrics_auth)

    def load_engine(status):
        from appliance.engine import Engine

        return Engine.load(model_dir, devices=devices, draft=draft, draft_tokens=draft_tokens, numerics=numerics,
                           dtype=dtype, path=op_path, chunk=chunk, context=context, graphs=not no_graphs,
                           status=status)

    try:
        code = run(config, load_engine)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ApplianceError(f"--port {port}: address already in use on {host} (another server? pick "
                                 f"another --port)", field="port", value=port) from None
        raise
    sys.exit(code)


# --- probe ---------------------------------------------------------------------------------------------


def _normalize_url(url: str) -> str:
    if "://" not in url:
        url = f"ws://{url}"
    scheme, rest = url.split("://", 1)
    scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    if "/" not in rest:
        rest += "/v1/stream"
    return f"{scheme}://{rest}"


@main.command()
@click.argument("url", default=DEFAULT_URL)
@click.option("--requests", "n_requests", type=int, default=20, show_default=True, help="measured requests")
@click.option("--warmup", type=int, default=2, show_default=True, help="requests run first and not counted")
@click.option("--isl", type=int, default=None, help="prompt length: random ids in the vocabulary (default 128)")
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
def probe(url, n_requests, warmup, isl, osl, prompt_file, token_file, json_path, jsonl_path, csv_path,
          plot_path, slo, seed, timeout):
    """Measure one user's latency against a running server, one request at a time: TTFT, time to second
    token, server TTFT and the overhead between, TPOT, tokens/s, every inter-token gap, e2e.

    Exit codes: 0 ok, 2 usage, 3 an SLO missed, 4 the box is busy or not ready, 5 unreachable."""
    import asyncio

    from server.probe import stats as probe_stats
    from server.probe.client import ProbeConfig, ProbeError, run_probe

    if prompt_file is not None and isl is not None:
        raise ApplianceError("give --isl (random ids) or --prompt-file, not both", field="isl")
    _check_range("--requests", n_requests, 1)
    _check_range("--warmup", warmup, 0)
    _check_range("--isl", isl, 1)
    _check_range("--osl", osl, 1, 8192)
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

    cfg = ProbeConfig(url=_normalize_url(url), requests=n_requests, warmup=warmup,
                      isl=None if prompt is not None else (isl or 128), osl=osl or 128, prompt=prompt,
                      ignore_eos=prompt is None or osl is not None,
                      token=read_token(token_file) if token_file else None, seed=seed, timeout_s=timeout)
    total = warmup + n_requests
    try:
        run = asyncio.run(run_probe(cfg, on_request=lambda rec: _progress(rec, total)))
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


# --- service -------------------------------------------------------------------------------------------


@main.group()
def service():
    """The systemd unit (Type=notify, watchdog, hardening that keeps the GPUs reachable) and its env file."""


@service.command("print")
@click.option("--prefix", default="/", show_default=True, help="root the files would be installed under")
@click.option("--user", default="decode-appliance", show_default=True, help="dedicated service user")
@click.option("--devices", default="cuda", show_default=True, help="APPLIANCE_DEVICES in the env file")
@friendly
def service_print(prefix, user, devices):
    """Show the unit and the env file that `install` would write."""
    from server import service as svc

    unit, env = svc.render(svc.this_executable(), user, prefix, devices)
    unit_path, env_path = svc.paths(prefix)
    click.echo(f"# --- {unit_path}\n{unit}\n# --- {env_path}\n{env}", nl=False)


@service.command()
@click.option("--prefix", default="/", show_default=True,
              help="write under PREFIX/etc/systemd/system and PREFIX/etc/decode-appliance")
@click.option("--user", default="decode-appliance", show_default=True, help="dedicated service user")
@click.option("--devices", default="cuda", show_default=True, help="APPLIANCE_DEVICES in the env file")
@friendly
def install(prefix, user, devices):
    """Write the unit and the env file (an existing env file is kept) and print the systemctl commands."""
    from server import service as svc

    unit_path, env_path, commands = svc.install(prefix, user, devices)
    click.echo(f"wrote {unit_path}", err=True)
    click.echo(f"env file {env_path} (edit APPLIANCE_MODEL, APPLIANCE_TOKEN_FILE there)", err=True)
    click.echo("to finish:", err=True)
    for c in commands:
        click.echo(c)
