"""The `appliance` command line. Every command that fails on its input prints one line to stderr naming
the problem and exits with status 2 (never a traceback)."""

import functools
import json
import sys
from pathlib import Path

import click

from appliance.errors import ApplianceError

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


def model_options(fn):
    """--model, --numerics, --dtype, --path, --index-keys: the options of every command that runs the model."""
    options = [
        click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None, help=MODEL_HELP),
        click.option("--numerics", type=click.Choice(["official", "plain"]), default="official", show_default=True,
                     help="official: the official code's FP8/FP4 activation and KV quantization emulation; "
                          "plain: dequantized weights without it (transformers' arithmetic for V4)"),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
                     help="activation dtype that every rounding point rounds to"),
        click.option("--path", "op_path", type=click.Choice(["auto", "reference", "fast"]), default="auto",
                     show_default=True, help="reference: plain torch ops; fast: the Triton kernels (on CPU under "
                                             "the Triton interpreter: slow, for tests); auto: fast on CUDA, "
                                             "reference on CPU"),
        click.option("--devices", default="cpu", show_default=True,
                     help="where the model runs: cpu, cuda, cuda:N"),
        click.option("--index-keys", type=click.Choice(["own", "reference"]), default="own", show_default=True,
                     help="V4.1: own = every index-key owner scores its own keys (what prefill computes); "
                          "reference = the released code's decode-time publication order, for parity checks"),
    ]
    for opt in reversed(options):
        fn = opt(fn)
    return fn


def _load(model_dir, numerics, dtype, op_path, devices="cpu", **kw):
    """Load for a command; with several devices every rank runs the command on its shard in lockstep
    (rank 0's output alone reaches stdout)."""
    from appliance.loader import load_model
    from appliance.parallel.world import start

    if model_dir is not None and not Path(model_dir).exists():
        raise ApplianceError(f"--model {model_dir}: no such directory", field="model")
    world = start(devices)
    return load_model(model_dir, numerics=numerics, dtype=dtype, path=op_path, device=devices,
                      notice=lambda m: click.echo(m, err=True) if world.main else None, world=world, **kw)


def _read_ids(path: Path) -> list[int]:
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ApplianceError(f"--ids {path}: not a JSON list of token ids ({e})", field="ids") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ApplianceError(f"--ids {path}: must hold a non-empty JSON list of integers", field="ids")
    return ids


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
    """


# --- generate ------------------------------------------------------------------------------------------


@main.command()
@model_options
@click.option("--prompt", help="prompt text (needs the model's tokenizer.json)")
@click.option("--ids", "ids_file", type=click.Path(path_type=Path), help="JSON file with a list of prompt token ids")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="tokens to generate (1..8192)")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off")
@click.option("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
@click.option("--ignore-eos", is_flag=True, help="do not stop at the end-of-sequence token")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (ids, text, usage, timings) at the end")
@click.option("--chunk", type=int, default=256, show_default=True, help="prefill chunk size")
@click.option("--draft", type=click.Choice(["none", "dspark", "mtp", "adaptive", "auto"]), default="none",
              show_default=True, help="speculative drafting (auto: the checkpoint's own drafter)")
@click.option("--draft-tokens", type=int, default=3, show_default=True, help="drafts per cycle (1..5 with DSpark)")
@click.option("--no-graphs", is_flag=True, help="on CUDA, run the decode cycle eagerly instead of replaying graphs")
@friendly
def generate(model_dir, numerics, dtype, op_path, devices, index_keys, prompt, ids_file, max_tokens, temperature,
             top_p, top_k, seed, ignore_eos, as_json, chunk, draft, draft_tokens, no_graphs):
    """Generate from a prompt and stream the text to stdout."""
    from appliance.api import Done, Error, Request, Sampling, Tokens
    from appliance.decode.generate import Generator

    if (prompt is None) == (ids_file is None):
        raise ApplianceError("give exactly one of --prompt or --ids", field="prompt")
    lm = _load(model_dir, numerics, dtype, op_path, devices, load_drafter=draft != "none")
    req = Request(id="cli", input_ids=_read_ids(ids_file) if ids_file else None, prompt=prompt,
                  max_tokens=max_tokens, sampling=Sampling(temperature, top_p, top_k, seed), ignore_eos=ignore_eos)
    gen = Generator(lm, chunk=chunk, index_keys=index_keys, draft=draft, draft_tokens=draft_tokens,
                    graphs=not no_graphs, notice=lambda m: click.echo(m, err=True) if lm.world.main else None)
    ids, text, done = [], [], None
    for event in gen.run(req):
        if isinstance(event, Tokens):
            ids += event.ids
            text.append(event.text)
            if not as_json:
                click.echo(event.text, nl=False)
        elif isinstance(event, Error):
            raise ApplianceError(event.message, field=event.param, code=event.code)
        elif isinstance(event, Done):
            done = event
    if as_json:
        out = {"ids": ids, "text": "".join(text), "finish_reason": done.finish_reason, "usage": done.usage,
               "timings": done.timings}
        if done.speculative:
            out["speculative"] = done.speculative
        click.echo(json.dumps(out))
    else:
        click.echo()
    if lm.world.distributed:
        lm.world.stop()


# --- score ---------------------------------------------------------------------------------------------


@main.command()
@model_options
@click.option("--ids", "ids_file", type=click.Path(path_type=Path), help="JSON file with a list of token ids")
@click.option("--text", help="text to score (needs the model's tokenizer.json)")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="output .safetensors file")
@click.option("--dump", default="", help="comma list of extra tensors: engram_ids, index_topk, main_hidden")
@click.option("--chunk", type=int, default=0, help="process in chunks of this size (0 = one forward)")
@friendly
def score(model_dir, numerics, dtype, op_path, devices, index_keys, ids_file, text, out, dump, chunk):
    """Teacher-forced float32 logits [T, V] of a token sequence, written under the key `logits`.

    With --dump, also the Engram row ids (engram_hash_ids [T, layers, cols]), each index-source layer's
    kept compressed positions (prefill_index_topk_layer{L} [T, k], -1 = unused) and the DSpark input per
    position (prefill_main_hidden [T, n_targets * D]), under the names of the official fixtures."""
    import torch
    from safetensors.torch import save_file

    dumps = {d for d in dump.split(",") if d}
    unknown = dumps - {"engram_ids", "index_topk", "main_hidden"}
    if unknown:
        raise ApplianceError(f"--dump {','.join(sorted(unknown))}: unknown (engram_ids, index_topk, main_hidden)",
                             field="dump")
    if (ids_file is None) == (text is None):
        raise ApplianceError("give exactly one of --ids or --text", field="ids")
    lm = _load(model_dir, numerics, dtype, op_path, devices)
    ids = _read_ids(ids_file) if ids_file else lm.tokenizer.encode(text)
    if not ids:
        raise ApplianceError("--text encodes to no tokens", field="text")
    bad = [i for i in ids if not 0 <= i < lm.cfg.vocab_size]
    if bad:
        raise ApplianceError(f"--ids: id {bad[0]} outside the vocabulary 0..{lm.cfg.vocab_size - 1}", field="ids")
    if len(ids) > lm.cfg.max_context:
        raise ApplianceError(f"{len(ids)} tokens exceed the maximum context {lm.cfg.max_context}", field="ids")
    state = lm.model.new_state(len(ids))
    tokens = torch.tensor(ids, device=lm.runtime.device)
    step = chunk if chunk > 0 else len(ids)
    logits, probes, hidden = [], [], []
    for s in range(0, len(ids), step):
        probe = {} if dumps else None
        with torch.inference_mode():
            o = lm.model.forward(tokens[s:s + step], state, index_keys=index_keys, probe=probe)
        logits.append(o.logits)
        probes.append(probe)
        hidden.append(o.hidden)
    result = {"logits": torch.cat(logits).float().cpu().contiguous()}
    if "engram_ids" in dumps and probes[0].get("engram_ids") is not None:
        result["engram_hash_ids"] = torch.cat([p["engram_ids"] for p in probes]).contiguous()
    if "index_topk" in dumps:
        for key in probes[0]:
            if key.startswith("index_topk."):
                L = key.split(".")[1]
                result[f"prefill_index_topk_layer{L}"] = torch.cat([p[key] for p in probes]).int().contiguous()
    if "main_hidden" in dumps and hidden[0] is not None:
        result["prefill_main_hidden"] = torch.cat(hidden).float().cpu().contiguous()
    if not lm.world.main:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(result, str(out))
    click.echo(f"wrote {out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in result.items()), err=True)
    lm.world.stop()


# --- tiny ----------------------------------------------------------------------------------------------


@main.command()
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--family", type=click.Choice(["deepseek_v41", "deepseek_v4", "deepseek_v4_0731"]),
              default="deepseek_v41", show_default=True,
              help="deepseek_v4 carries the April MTP head; deepseek_v4_0731 the DSpark drafter")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shape", type=click.Choice(["tiny", "slice"]), default="tiny", show_default=True,
              help="slice (deepseek_v41): 4 layers of V4.1-Flash at full width (about 5 GB), for GPU measurements")
@friendly
def tiny(out_dir, family, seed, shape):
    """Write a tiny random checkpoint (official names and formats, FP8/FP4, tokenizer.json) to OUT_DIR."""
    from appliance.model.tiny import write_tiny

    out = write_tiny(out_dir, family, seed, shape=shape)
    click.echo(f"wrote a tiny {family} checkpoint to {out}", err=True)


# --- info ----------------------------------------------------------------------------------------------


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None, help=MODEL_HELP)
@click.option("--devices", "n_devices", type=int, default=None,
              help="plan memory per rank for the model split over this many GPUs")
@click.option("--gpu-memory", default=None, help="memory of one GPU for the plan, e.g. 288GB (B300), 141GB (H200)")
@click.option("--context", type=int, default=None, help="context length for the plan (default: the model's maximum)")
@click.option("--json", "as_json", is_flag=True, help="print JSON (with `fits` and the per-rank table)")
@friendly
def info(model_dir, n_devices, gpu_memory, context, as_json):
    """Architecture summary, layer roles, weight bytes by dtype and by where they live, and decode-state
    bytes per token of context. With --devices and --gpu-memory, the memory plan of one rank. Needs only
    config.json (weights are not read)."""
    from appliance.loader import default_model_dir
    from appliance.measure import costs as inf
    from appliance.measure.memory import parse_bytes, rank_plan
    from appliance.model.config import load_config, summary

    cfg = load_config(model_dir or default_model_dir())
    report = {"config": summary(cfg), "layers": inf.layer_roles(cfg), "weights": inf.weight_bytes(cfg),
              "state": inf.state_bytes(cfg)}
    if (n_devices is None) != (gpu_memory is None):
        raise ApplianceError("give --devices and --gpu-memory together for a memory plan", field="devices")
    if n_devices is not None:
        if n_devices < 1:
            raise ApplianceError(f"--devices {n_devices}: must be at least 1", field="devices")
        try:
            capacity = parse_bytes(gpu_memory)
        except ValueError:
            raise ApplianceError(f"--gpu-memory {gpu_memory}: not a size like 288GB", field="gpu_memory") from None
        ctx = context or cfg.max_context
        plan = rank_plan(cfg, ctx, capacity, n_devices)
        report["plan"] = {"devices": n_devices, "gpu_memory": capacity, "context": ctx, "fits": plan.fits,
                          "per_rank": plan.parts, "total_per_rank": plan.total,
                          "free_per_rank": capacity - plan.total,
                          "weights_per_rank": inf.rank_weights(cfg, n_devices)}
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print_info(cfg, report, inf.human)


def _print_info(cfg, report, human):
    c = cfg
    click.echo(f"{c.family}: {c.n_layers} layers, hidden {c.dim}, {c.n_heads} heads x {c.head_dim} "
               f"(RoPE {c.rope_head_dim}), q-LoRA {c.q_lora_rank}, {c.o_groups} output groups x {c.o_lora_rank}")
    click.echo(f"  experts: {c.n_routed_experts} routed (top-{c.n_activated_experts}) + {c.n_shared_experts} shared, "
               f"intermediate {c.moe_inter_dim}; mHC x{c.hc_mult}; window {c.window_size}; "
               f"indexer {c.index_n_heads} x {c.index_head_dim} top-{c.index_topk}; vocab {c.vocab_size}")
    if c.dspark:
        d = c.dspark
        click.echo(f"  drafter: DSpark, {d.n_stages} stages, block {d.block_size}, targets {list(d.target_layer_ids)}, "
                   f"{d.n_routed_experts} experts top-{d.n_activated_experts}")
    elif c.family == "deepseek_v4" and c.n_mtp_layers:
        click.echo("  drafter: MTP head (1 layer)")
    click.echo("layers:")
    for row in report["layers"]:
        extra = " ".join(k for k in ("engram", "dspark_input", "hash_moe") if row.get(k))
        src = f" kv<-{row['kv_from']} topk<-{row['topk_from']}" if row.get("kv_from") is not None else ""
        click.echo(f"  {row['layer']:>3}  ratio {row['ratio']:>3}  {row['mode']:<26}{src} {extra}".rstrip())
    w = report["weights"]
    click.echo(f"weights: {human(w['total'])} in {w['tensors']} tensors")
    for k, v in sorted(w["by_dtype"].items(), key=lambda kv: -kv[1]):
        click.echo(f"  {k:<8} {human(v)}")
    click.echo("  by part: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_part"].items()))
    click.echo("  where: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_where"].items()))
    s = report["state"]
    click.echo(f"decode state per token of context: {s['per_token_packed']:.1f} B packed "
               f"({s['per_token_reference_bf16']:.1f} B as bf16 rows); constant {human(s['constant_packed'])} packed")
    plan = report.get("plan")
    if plan:
        click.echo(f"memory plan per rank: {plan['devices']} x {human(plan['gpu_memory'])}, context {plan['context']}: "
                   f"{'fits' if plan['fits'] else 'DOES NOT FIT'}")
        for part, n in plan["per_rank"].items():
            click.echo(f"  {part:<14} {human(n):>10}")
        click.echo(f"  {'total':<14} {human(plan['total_per_rank']):>10}   free {human(plan['free_per_rank'])}")
        w = plan["weights_per_rank"]
        click.echo("  weights by dtype: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_dtype"].items()))
        click.echo("  weights by part: " + ", ".join(f"{k} {human(v)}" for k, v in w["by_part"].items()))
        click.echo(f"  host (memory-mapped once per box): Engram tables {human(w['host_engram_tables'])}")


def run():
    main()


# Command groups that live in their own modules register themselves on `main` when imported.
from . import bench as cli_bench  # noqa: E402,F401

from . import serve as cli_serve  # noqa: E402,F401  # isort: skip
from appliance.measure import bench  # noqa: E402,F401  (registers `bench decode | forward | prefill`)

from .chat import chat  # noqa: E402  # isort: skip

main.add_command(chat)
