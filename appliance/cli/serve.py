"""`appliance serve`: the server in front of the engine (decode.v1 websocket and the OpenAI/Anthropic API on
one port). The `server` package is imported inside the command, never at module level, so the rest of the
CLI does not pay for (or depend on) aiohttp and prometheus."""

import errno
import os
import sys
from pathlib import Path

import click

from appliance.errors import ApplianceError
from appliance.options import RunOptions

from .common import check_model_dir, check_range, friendly, run_options


def _token(token_file) -> str | None:
    from server.gate import read_token

    if token_file is not None:
        return read_token(token_file)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")  # systemd LoadCredential=token:...
    if creds and (Path(creds) / "token").is_file():
        return read_token(Path(creds) / "token")
    return None


@click.command()
@run_options()
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
              help="browser origin allowed to use the websocket and the API (repeatable; `*` for any; the API "
                   "answers its CORS preflight); none: browsers are refused (403)")
@click.option("--on-busy", type=click.Choice(["queue", "reject"]), default="queue", show_default=True,
              envvar="APPLIANCE_ON_BUSY",
              help="a request while another runs (an agent's side request, a parallel batch): wait in line (the "
                   "websocket hears queued{position}) or refuse it (busy, HTTP 429, close 1013)")
@click.option("--queue-max", type=int, default=16, show_default=True, envvar="APPLIANCE_QUEUE_MAX",
              help="--on-busy queue: the most requests or connections waiting; one more is refused as busy")
@click.option("--queue-wait", type=float, default=600.0, show_default=True, envvar="APPLIANCE_QUEUE_WAIT",
              help="--on-busy queue: seconds a request may wait for its turn; then it is refused as busy")
@click.option("--idle-timeout", type=float, default=300.0, show_default=True, envvar="APPLIANCE_IDLE_TIMEOUT",
              help="seconds a connection may hold the box without sending anything (0: forever); then close 4408")
@click.option("--drain", type=float, default=5.0, show_default=True, envvar="APPLIANCE_DRAIN",
              help="on SIGTERM, seconds the running request may finish before it is cancelled (the process exits "
                   "at most 15 s after that, whatever its connections do)")
@click.option("--keepalive", type=float, default=1.0, show_default=True, envvar="APPLIANCE_KEEPALIVE",
              help="seconds without a frame during a prefill before the server sends a progress keepalive")
@click.option("--sse-keepalive", type=float, default=5.0, show_default=True, envvar="APPLIANCE_SSE_KEEPALIVE",
              help="seconds an API stream may stay silent (a long prefill, a slow step) before it gets a "
                   "keep-alive: an SSE comment (OpenAI) or an event: ping (Anthropic), for proxies that time out")
@click.option("--send-deadline", type=float, default=30.0, show_default=True, envvar="APPLIANCE_SEND_DEADLINE",
              help="seconds one write to a client may wait; a client that reads no sooner is dropped and its "
                   "request cancelled (it cannot hold the box)")
@click.option("--header-timeout", type=float, default=30.0, show_default=True, envvar="APPLIANCE_HEADER_TIMEOUT",
              help="seconds a connection has to send a whole request's headers (and an idle keep-alive "
                   "connection stays open)")
@click.option("--body-timeout", type=float, default=30.0, show_default=True, envvar="APPLIANCE_BODY_TIMEOUT",
              help="seconds a request's body has to arrive after its headers (then 408)")
@click.option("--max-connections", type=int, default=256, show_default=True, envvar="APPLIANCE_MAX_CONNECTIONS",
              help="open connections at once; one more is answered 503 and closed")
@friendly
def serve(options: RunOptions, host, port, token_file, metrics_auth, origins, on_busy, queue_max, queue_wait,
          idle_timeout, drain, keepalive, sse_keepalive, send_deadline, header_timeout, body_timeout,
          max_connections):
    """Serve the model over websocket (protocol decode.v1, ws://HOST:PORT/v1/stream) and the OpenAI- and
    Anthropic-compatible API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models,
    /v1/messages, /v1/messages/count_tokens), with /healthz, /readyz and /metrics on the same port. One
    request runs at a time; the others wait in line. SIGTERM drains and exits 0.

    Every option can also come from the environment variable APPLIANCE_<OPTION> (the systemd env file)."""
    from appliance.parallel.world import start
    from server.app import ServerConfig, run

    def load_engine(status=None):
        from appliance.engine import Engine  # torch loads here, after the port answers /healthz

        return Engine.load(options, status=status)

    world = start(options.devices)
    if not world.main:  # ranks 1..n-1 of a split model: no server, they follow rank 0's jobs until it closes and
        # exit; their notices (own caches) are logged
        load_engine(lambda m: click.echo(f"appliance: rank {world.rank}: {m}", err=True))
        return
    check_model_dir(options)
    check_range("--port", port, 0, 65535)
    check_range("--keepalive", keepalive, 0.05, 2.0, " (decode.v1 promises a frame at least every 2 s)")
    check_range("--idle-timeout", idle_timeout, 0)
    check_range("--drain", drain, 0)
    check_range("--queue-max", queue_max, 1)
    check_range("--queue-wait", queue_wait, 0.1)
    check_range("--sse-keepalive", sse_keepalive, 0.1)
    for name, value in (("--send-deadline", send_deadline), ("--header-timeout", header_timeout),
                        ("--body-timeout", body_timeout)):
        check_range(name, value, 0.5)
    check_range("--max-connections", max_connections, 2)
    token = _token(token_file)
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"appliance: warning: serving on {host} without a token: anyone who reaches the port can "
                   f"use the box (--token-file)", err=True)
    config = ServerConfig(host=host, port=port, token=token, origins=tuple(origins), on_busy=on_busy,
                          queue_max=queue_max, queue_wait_s=queue_wait, idle_timeout_s=idle_timeout,
                          keepalive_s=keepalive, sse_keepalive_s=sse_keepalive, send_deadline_s=send_deadline,
                          header_timeout_s=header_timeout, body_timeout_s=body_timeout, max_connections=max_connections,
                          drain_s=drain, metrics_auth=metrics_auth)
    try:
        code = run(config, load_engine)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ApplianceError(f"--port {port}: address already in use on {host} (another server? pick "
                                 f"another --port)", field="port", value=port) from None
        raise
    sys.exit(code)
