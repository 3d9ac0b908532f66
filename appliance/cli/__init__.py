"""The `appliance` command line: one module per command family (run: generate and score; tiny; info;
chat; bench; serve; probe; service), the group assembled here. Every command that fails on its input
prints one line to stderr naming the problem and exits with status 2 (never a traceback)."""

import click

from .bench import bench
from .bench_prefix import agent as bench_agent
from .bench_prefix import prefix as bench_prefix
from .chat import chat
from .info import info
from .probe import probe
from .run import generate, score
from .serve import serve
from .service import service
from .tiny import tiny


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="decode-appliance")
def main():
    """decode-appliance: a single-user, lowest-latency decode server for DeepSeek-V4.1-Flash and the
    DeepSeek-V4-Flash family.

    \b
    Start here:
      appliance generate --prompt "Hello"        generate with the embedded tiny model
      appliance serve                            serve it over websocket (decode.v1)
      appliance tiny /tmp/m --family deepseek_v4 write a tiny random checkpoint
      appliance info --model DIR                 architecture, weight bytes, state bytes per token

    Every model option also reads APPLIANCE_<OPTION> from the environment (APPLIANCE_MODEL, APPLIANCE_DEVICES,
    APPLIANCE_DRAFT, ...), as the systemd env file sets them.
    """


for command in (generate, score, tiny, info, chat, bench, serve, probe, service):
    main.add_command(command)
for command in (bench_agent, bench_prefix):
    bench.add_command(command)

__all__ = ["main"]
