"""What every command shares: one-line errors with exit status 2, the run options (declared once, each
with its APPLIANCE_* environment variable) and loading a model for a command."""

import functools
import json
import sys
from pathlib import Path

import click

from appliance.errors import ApplianceError
from appliance.options import ALLREDUCE, DRAFTS, DTYPES, EXPERTS, INDEX_KEYS, NUMERICS, PATHS, RunOptions

MODEL_HELP = "model directory (config.json + *.safetensors); default: the embedded tiny DeepSeek-V4.1 model"


def fail(message: str, code: int = 2):
    click.echo(f"appliance: error: {message}", err=True)
    sys.exit(code)


def friendly(fn):
    """Turn the errors a user can cause into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ApplianceError as e:
            fail(e.message)
        except (OSError, ValueError) as e:
            fail(str(e))

    return wrapper


def _env(name: str) -> str:
    return f"APPLIANCE_{name.upper()}"


# (parameter, click declaration) in the order --help lists them; `decode` options only where a command decodes
def model_option():
    return click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None, envvar=_env("model"),
                        help=MODEL_HELP)


_MODEL_OPTIONS = [
    ("model_dir", model_option),
    ("devices", lambda: click.option(
        "--devices", default="cpu", show_default=True, envvar=_env("devices"),
        help="where the model runs: cpu, cuda, cuda:N; several devices run one process each: 0,1,2,3 (four GPUs, "
             "the box this is built for) or cpu:4 (four CPU processes, for tests)")),
    ("numerics", lambda: click.option(
        "--numerics", type=click.Choice(NUMERICS), default="official", show_default=True, envvar=_env("numerics"),
        help="official: the official code's FP8/FP4 activation and KV quantization emulation; plain: dequantized "
             "weights without it (transformers' arithmetic for V4)")),
    ("allreduce", lambda: click.option(
        "--allreduce", type=click.Choice(ALLREDUCE), default="auto", show_default=True, envvar=_env("allreduce"),
        help="several devices: how partial sums meet, always added in rank order (bitwise the same on every rank "
             "and for every batch); nccl: an all-gather (gloo on CPU); symm: symmetric memory, GPU peer-to-peer; "
             "auto: symm where the GPUs reach each other")),
    ("experts", lambda: click.option(
        "--experts", type=click.Choice(EXPERTS), default="auto", show_default=True, envvar=_env("experts"),
        help="several devices: where the MoE's experts live; split: every rank a share of each expert (its "
             "intermediate), so no rank reads more of a step's experts than another; whole: each rank a quarter "
             "of the experts whole (the busiest rank reads ~1.9x the mean); auto: split where the slices keep "
             "the checkpoint's scale blocks whole, else whole (`bench model` prices both)")),
    ("check_ranks", lambda: click.option(
        "--check-ranks", is_flag=True, envvar=_env("check_ranks"),
        help="several devices, for diagnosis: before every collective the ranks compare the call they make, and "
             "after every request their whole decode state; a difference ends the request with an error naming "
             "both ranks' calls or states (costs a small collective per collective)")),
    ("dtype", lambda: click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
                                   envvar=_env("dtype"), help="activation dtype that every rounding point rounds to")),
    ("path", lambda: click.option(
        "--path", "path", type=click.Choice(PATHS), default="auto", show_default=True, envvar=_env("path"),
        help="reference: plain torch ops; fast: the Triton kernels (on CPU under the Triton interpreter: slow, for "
             "tests); auto: fast on CUDA, reference on CPU")),
    ("index_keys", lambda: click.option(
        "--index-keys", type=click.Choice(INDEX_KEYS), default="own", show_default=True, envvar=_env("index_keys"),
        help="V4.1: own = every index-key owner scores its own keys (what prefill computes); reference = the "
             "released code's decode-time publication order, for parity checks")),
]
_DECODE_OPTIONS = [
    ("draft", lambda: click.option("--draft", type=click.Choice(DRAFTS), default="none", show_default=True,
                                   envvar=_env("draft"),
                                   help="speculative drafting (auto: the checkpoint's own drafter; adaptive: DSpark "
                                        "trims each block by its confidence head)")),
    ("draft_tokens", lambda: click.option("--draft-tokens", type=int, default=3, show_default=True,
                                          envvar=_env("draft_tokens"), help="drafts per cycle (1..5 with DSpark)")),
    ("chunk", lambda: click.option("--chunk", type=int, default=RunOptions.chunk, show_default=True,
                                   envvar=_env("chunk"),
                                   help="prefill chunk: rows one forward takes, at most 8192 (cancel and progress act "
                                        "between chunks; checkpoints are taken inside them)")),
    ("context", lambda: click.option("--context", type=int, default=None, envvar=_env("context"),
                                     help="context limit in tokens (default: the model's, capped by memory)")),
    ("no_graphs", lambda: click.option("--no-graphs", is_flag=True, envvar=_env("no_graphs"),
                                       help="on CUDA, run the decode cycle eagerly instead of replaying CUDA graphs")),
    ("checkpoint_stride", lambda: click.option(
        "--checkpoint-stride", type=int, default=2048, show_default=True, envvar=_env("checkpoint_stride"),
        help="positions between checkpoints of the state's rings (also taken at each prompt's end, each "
             "request's end and where a prompt branches off): a rewind to any position prefills at most this many "
             "ids again (0: no checkpoints, rewinds only within the last 16 positions)")),
    ("prefix_cache_gb", lambda: click.option(
        "--prefix-cache-gb", type=float, default=8.0, show_default=True, envvar=_env("prefix_cache_gb"),
        help="host memory (GB, pinned with a GPU) for earlier conversations, least recently used evicted "
             "first; a prompt restores the longest prefix any of them shares (0: only the live state)")),
    ("prefix_cache_dir", lambda: click.option(
        "--prefix-cache-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
        envvar=_env("prefix_cache_dir"),
        help="also keep cached conversations in this directory: they survive a restart (files made by another "
             "model, numerics, dtype or path are ignored)")),
    ("prefix_cache_disk_gb", lambda: click.option(
        "--prefix-cache-disk-gb", type=float, default=64.0, show_default=True, envvar=_env("prefix_cache_disk_gb"),
        help="the disk tier's budget (GB), least recently used files removed first")),
]


def run_options(decode: bool = True, leave_out: tuple[str, ...] = ()):
    """Declare the model options (and with `decode` the decoding ones: drafting, chunk, context, graphs) and
    hand the command one `options: RunOptions`. Every option also reads APPLIANCE_<OPTION>. `leave_out`: a
    command whose own option of that name means something else (bench's --context: depths to measure at)."""
    declared = [(n, o) for n, o in _MODEL_OPTIONS + (_DECODE_OPTIONS if decode else []) if n not in leave_out]

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name) for name, _ in declared}
            if "no_graphs" in values:
                values["graphs"] = not values.pop("no_graphs")
            try:
                options = RunOptions(**values)
            except ApplianceError as e:
                fail(e.message)
            return fn(*args, options=options, **kwargs)

        for _, option in reversed(declared):
            wrapper = option()(wrapper)
        return wrapper

    return decorate


def check_range(name: str, value, lo, hi=None, hint: str = "") -> None:
    if value is None:
        return
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ApplianceError(f"{name} {value}: must be {bound}{hint}", field=name.lstrip("-"), value=value)


def check_model_dir(options: RunOptions) -> None:
    if options.model_dir is not None and not options.model_dir.is_dir():
        raise ApplianceError(f"--model {options.model_dir}: no such directory", field="model")


def load(options: RunOptions, **kw):
    """Load for a command; with several devices every rank runs the command on its shard in lockstep
    (rank 0's output alone reaches stdout)."""
    from appliance.loader import load_model
    from appliance.parallel.world import start

    check_model_dir(options)
    world = start(options.devices)
    return load_model(options, notice=lambda m: click.echo(m, err=True) if world.main else None, world=world, **kw)


def read_ids(path: Path) -> list[int]:
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ApplianceError(f"--ids {path}: not a JSON list of token ids ({e})", field="ids") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApplianceError(f"--ids {path}: must hold a non-empty JSON list of integers", field="ids")
    return ids
