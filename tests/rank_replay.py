"""One rank of a group in lockstep (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun sets them):
greedy tokens on the fast path from eager cycles without drafting, then from cycles replayed from their
captures (tests/graph_replay.py: the collectives replayed with the rest), without and with the drafter, and
what each capture did that a CUDA graph refuses (the cycle recorder: host reads, host data). Rank 0 runs
the request, the others its job; each writes rank<r>.json (and its output, rank<r>.log) into --out. Started
without RANK, it starts the ranks itself (tests/ranks.py `launch`) and says whether they agree.

    python -m tests.rank_replay --model DIR --devices cpu:4 --prompt '[3, 4, ...]' --tokens 3 --draft dspark \
        [--allreduce symm] --out DIR
"""

import argparse
import json
import os
import sys
from pathlib import Path

import graphs.runner
from appliance.api import Request
from appliance.decode.loop import RequestLoop
from appliance.decode.session import DecodeSession, Sampled
from appliance.loader import load_model
from appliance.measure.recorder import Recorder, unique_violations
from appliance.options import RunOptions
from appliance.parallel.world import parse_devices, start

from .graph_replay import ReplayRunner, one_reach
from .ranks import launch


def greedy(lm, options: RunOptions, prompt: list[int], tokens: int) -> list[int]:
    """Rank 0: the request's greedy tokens; the others: the tokens their run of rank 0's job sampled."""
    reach = one_reach(len(prompt), tokens)
    session = DecodeSession(lm, options, capacity=reach, reach_floor=reach)
    if not lm.world.main:
        steps = session.run(lm.world.next_job())
        return [t for step in steps if isinstance(step, Sampled) for t in step.tokens][:tokens]
    loop = RequestLoop(session, lm.tokenizer, lm.model_dir)
    ids = []
    for event in loop.run(Request(input_ids=prompt, max_tokens=tokens, ignore_eos=True)):
        ids += getattr(event, "ids", [])
    return ids


def agreement(ranks: list[dict]) -> list[str]:
    """What the ranks' results say, one line a run: its tokens on every rank and against the replayed plain
    run's (the drafter must not change them, nor capture), then the capture violations."""
    lines = []
    plain = ranks[0]["replayed"].get("none")
    for run in ["eager", *ranks[0]["replayed"]]:
        tokens = [r["eager"] if run == "eager" else r["replayed"][run] for r in ranks]
        if tokens[0] is None:
            continue
        same = all(t == tokens[0] for t in tokens)
        line = f"{run}: {len(tokens[0])} tokens, {'the same' if same else 'DIFFERENT'} on every rank"
        if plain is not None and run != "none":
            line += ", " + ("equal to" if tokens[0] == plain else "DIFFERENT from") + " replayed plain (none)"
        lines.append(line)
    lines.append(f"capture violations: {sum(len(r['violations']) for r in ranks)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--devices", default="cpu:4")
    ap.add_argument("--prompt", required=True, help="JSON list of token ids")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--draft", default="dspark")
    ap.add_argument("--allreduce", default="auto", help="how the ranks' sums meet (RunOptions.allreduce): symm runs "
                    "the box's in-kernel waits over buffers in shared memory")
    ap.add_argument("--runs", default="eager,plain,drafted",
                    help="which runs, in this order: eager (plain cycles, not captured), plain (replayed without "
                         "drafting), drafted (replayed with --draft); long runs may leave out eager (the suite's)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = args.runs.split(",")
    if set(runs) - {"eager", "plain", "drafted"}:
        ap.error(f"--runs {args.runs}: a comma-separated choice of eager, plain, drafted")
    if "RANK" not in os.environ:  # started by hand: start the ranks
        args.out.mkdir(parents=True, exist_ok=True)
        ranks = launch("tests.rank_replay", sys.argv[1:], args.out, len(parse_devices(args.devices)))
        print("\n".join(agreement(ranks)))
        return
    world = start(args.devices)
    prompt = json.loads(args.prompt)
    options = RunOptions(model_dir=args.model, devices=args.devices, path="fast", draft=args.draft, draft_tokens=3,
                         allreduce=args.allreduce)
    lm = load_model(options, notice=None, world=world)
    plain = RunOptions(model_dir=args.model, devices=args.devices, path="fast", draft="none",
                       allreduce=args.allreduce)
    eager = greedy(lm, plain, prompt, args.tokens) if "eager" in runs else None
    result = {"rank": world.rank, "eager": eager, "replayed": {}, "violations": []}

    def checked_replay(step, device, graphs=True, pool=None, check_inputs=False):
        step()  # the warm-up a capture makes (first calls build caches: the MoE's expert address tables)
        with Recorder(label=type(step).__name__) as rec:  # the capture
            runner = ReplayRunner(step, warmup=0)
        result["violations"] += unique_violations(rec.violations)
        return runner

    graphs.runner.make_runner = checked_replay
    for run, opts in (("plain", plain), ("drafted", options)):
        if run in runs:
            result["replayed"][opts.draft] = greedy(lm, opts, prompt, args.tokens)
        # written after every run: a long run's finished parts survive an interrupted one
        (args.out / f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
