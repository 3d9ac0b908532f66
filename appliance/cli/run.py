"""`appliance generate` and `appliance score`: run the model once from the command line."""

import json
from pathlib import Path

import click

from appliance.errors import ApplianceError
from appliance.options import RunOptions

from .common import friendly, load, read_ids, run_options


@click.command()
@run_options()
@click.option("--prompt", help="prompt text (needs the model's tokenizer.json)")
@click.option("--ids", "ids_file", type=click.Path(path_type=Path), help="JSON file with a list of prompt token ids")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="tokens to generate")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off")
@click.option("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
@click.option("--ignore-eos", is_flag=True, help="do not stop at the end-of-sequence token")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (ids, text, usage, timings) at the end")
@friendly
def generate(options: RunOptions, prompt, ids_file, max_tokens, temperature, top_p, top_k, seed, ignore_eos,
             as_json):
    """Generate from a prompt and stream the text to stdout."""
    from appliance.api import Done, Error, Request, Sampling, Tokens
    from appliance.decode.loop import RequestLoop
    from appliance.decode.session import DecodeSession

    if (prompt is None) == (ids_file is None):
        raise ApplianceError("give exactly one of --prompt or --ids", field="prompt")
    lm = load(options)
    say = (lambda m: click.echo(m, err=True)) if lm.world.main else None
    loop = RequestLoop(DecodeSession(lm, options, capacity=options.context, notice=say), lm.tokenizer, lm.model_dir)
    if not lm.world.main:  # several ranks: the others run rank 0's job
        loop.session.follow()
        return
    req = Request(id="cli", input_ids=read_ids(ids_file) if ids_file else None, prompt=prompt,
                  max_tokens=max_tokens, sampling=Sampling(temperature, top_p, top_k, seed), ignore_eos=ignore_eos)
    ids, text, done = [], [], None
    for event in loop.run(req):
        if isinstance(event, Tokens):
            ids += event.ids
            text.append(event.text)
            if not as_json:
                click.echo(event.text, nl=False)
        elif isinstance(event, Error):
            if lm.world.distributed:
                lm.world.publish(None)
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
        lm.world.publish(None)  # the others' follow() ends
        lm.world.stop()


DUMPS = ("engram_ids", "index_topk", "main_hidden")


@click.command()
@run_options(decode=False)
@click.option("--ids", "ids_file", type=click.Path(path_type=Path), help="JSON file with a list of token ids")
@click.option("--text", help="text to score (needs the model's tokenizer.json)")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="output .safetensors file")
@click.option("--dump", default="", help=f"comma list of extra tensors: {', '.join(DUMPS)}")
@click.option("--split", type=int, default=0, show_default=True,
              help="score in forwards of this many tokens (0 = one forward over the whole sequence)")
@friendly
def score(options: RunOptions, ids_file, text, out, dump, split):
    """Teacher-forced float32 logits [T, V] of a token sequence, written under the key `logits`.

    With --dump, also the Engram row ids (engram_hash_ids [T, layers, cols]), each index-source layer's
    kept compressed positions (prefill_index_topk_layer{L} [T, k], -1 = unused) and the DSpark input per
    position (prefill_main_hidden [T, n_targets * D]), under the names of the official fixtures."""
    from contextlib import ExitStack

    import torch
    from safetensors.torch import save_file

    from appliance.measure.selections import engram_ids, index_topk
    from appliance.model.tokenizer import check_ids

    dumps = {d for d in dump.split(",") if d}
    unknown = dumps - set(DUMPS)
    if unknown:
        raise ApplianceError(f"--dump {','.join(sorted(unknown))}: unknown ({', '.join(DUMPS)})", field="dump")
    if (ids_file is None) == (text is None):
        raise ApplianceError("give exactly one of --ids or --text", field="ids")
    if split < 0:
        raise ApplianceError(f"--split {split}: must be >= 0", field="split", value=split)
    lm = load(options)
    ids = read_ids(ids_file) if ids_file else lm.tokenizer.encode(text)
    check_ids(ids, lm.cfg, lm.cfg.max_context)
    state = lm.model.new_state(len(ids))
    tokens = torch.tensor(ids, device=lm.runtime.device)
    step = split if split > 0 else len(ids)
    logits, hidden = [], []
    with ExitStack() as recording:
        row_ids = recording.enter_context(engram_ids(lm.model)) if "engram_ids" in dumps else []
        kept = recording.enter_context(index_topk(lm.model)) if "index_topk" in dumps else {}
        for s in range(0, len(ids), step):
            with torch.inference_mode():
                o = lm.model.forward(tokens[s:s + step], state, index_keys=options.index_keys)
            logits.append(o.logits)
            hidden.append(o.hidden)
    result = {"logits": torch.cat(logits).float().cpu().contiguous()}
    if row_ids:
        result["engram_hash_ids"] = torch.cat(row_ids).contiguous()
    for L, rows in kept.items():  # a forward's rows are as wide as what it could see: -1 pads the earlier ones
        width = max(r.shape[1] for r in rows)
        result[f"prefill_index_topk_layer{L}"] = torch.cat(
            [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=-1) for r in rows]).int().contiguous()
    if "main_hidden" in dumps and hidden[0] is not None:
        result["prefill_main_hidden"] = torch.cat(hidden).float().cpu().contiguous()
    if not lm.world.main:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(result, str(out))
    click.echo(f"wrote {out}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in result.items()), err=True)
    lm.world.stop()
