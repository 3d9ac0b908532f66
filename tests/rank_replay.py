"""One rank of a group the test starts (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, as torchrun sets them):
greedy tokens on the fast path from eager cycles without drafting, then from cycles replayed from their
captures (tests/graph_replay.py: the collectives replayed with the rest), without and with the drafter, and
what each capture did that a CUDA graph refuses (the cycle recorder: host reads, host data). Every rank runs
the same request in lockstep; each writes rank<r>.json into --out.

    python -m tests.rank_replay --model DIR --devices cpu:4 --prompt '[3, 4, ...]' --tokens 3 --draft dspark --out DIR
"""

import argparse
import json
from pathlib import Path

import graphs.runner
from appliance.api import Request
from appliance.decode.loop import RequestLoop
from appliance.decode.session import DecodeSession
from appliance.loader import load_model
from appliance.measure.recorder import Recorder, unique_violations
from appliance.options import RunOptions
from appliance.parallel.world import start

from .graph_replay import ReplayRunner, one_reach


def greedy(lm, options: RunOptions, prompt: list[int], tokens: int) -> list[int]:
    reach = one_reach(len(prompt), tokens)
    loop = RequestLoop(DecodeSession(lm, options, capacity=reach, reach_floor=reach), lm.tokenizer, lm.model_dir)
    ids = []
    for event in loop.run(Request(input_ids=prompt, max_tokens=tokens, ignore_eos=True)):
        ids += getattr(event, "ids", [])
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--devices", default="cpu:4")
    ap.add_argument("--prompt", required=True, help="JSON list of token ids")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--draft", default="dspark")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    world = start(args.devices)
    prompt = json.loads(args.prompt)
    options = RunOptions(model_dir=args.model, devices=args.devices, path="fast", draft=args.draft, draft_tokens=3)
    lm = load_model(options, notice=None, world=world)
    plain = RunOptions(model_dir=args.model, devices=args.devices, path="fast", draft="none")
    result = {"rank": world.rank, "eager": greedy(lm, plain, prompt, args.tokens), "replayed": {}, "violations": []}

    def checked_replay(step, device, graphs=True, pool=None, check_inputs=False):
        step()  # the warm-up a capture makes (first calls build caches: the MoE's expert address tables)
        with Recorder(label=type(step).__name__) as rec:  # the capture
            runner = ReplayRunner(step, warmup=0)
        result["violations"] += unique_violations(rec.violations)
        return runner

    graphs.runner.make_runner = checked_replay
    for opts in (plain, options):
        result["replayed"][opts.draft] = greedy(lm, opts, prompt, args.tokens)
    (args.out / f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
