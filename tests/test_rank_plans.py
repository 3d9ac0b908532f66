"""Four ranks decide nothing alone: rank 0 plans each request (appliance/decode/plan.py) and every rank carries
out its plan; a follower made to do otherwise is named, with both ranks' plans or calls, never left to the
transport, and the service goes on. Each test starts four gloo ranks (tests/ranks.py) on the reference path of
the embedded tiny V4.1 (seconds)."""

import random

import pytest

from appliance.api import Done, Error, Request
from appliance.decode.loop import RequestLoop
from appliance.decode.plan import COLD
from appliance.decode.session import DecodeSession
from appliance.loader import load_model
from appliance.options import RunOptions

from .ranks import call

CHUNK = 8


def sabotage(session, how: str) -> None:
    """Make this follower leave rank 0's plan in the second job: `restore`, it starts from the empty state
    whatever the plan says; `chunk`, it prefills in chunks of 3 where the plan says CHUNK."""
    world, timeline = session.world, session.timeline
    execute, prefill = timeline.execute, session.prefill
    if how == "restore":
        timeline.execute = lambda ids, plan: execute(ids, COLD if world.jobs == 2 else plan)
    else:
        session.prefill = lambda ids, proceed=None, chunk=None: prefill(ids, proceed, 3 if world.jobs == 2 else chunk)


def diverging_follower(world, how: str, check_ranks: bool, seed: int) -> list:
    """Every rank: rank 0 serves A, then B (A's conversation continued: the live state restores it), then A
    again (the prefix cache restores it); rank 2 leaves the plan in B. Rank 0 returns each request's end."""
    options = RunOptions(devices="cpu:4", chunk=CHUNK, check_ranks=check_ranks)
    lm = load_model(options, notice=None, world=world)
    session = DecodeSession(lm, options, capacity=256)
    if world.rank == 2:
        sabotage(session, how)
    if not world.main:
        session.follow()
        return []
    rng = random.Random(seed)
    a = [lm.cfg.bos_token_id] + [rng.randrange(8, 500) for _ in range(11)]
    loop = RequestLoop(session, lm.tokenizer)
    ends, generated = [], []
    for ids in (a, None, a):
        ids = ids or a + generated[:3] + [rng.randrange(8, 500) for _ in range(10)]
        events = list(loop.run(Request(input_ids=ids, max_tokens=4, ignore_eos=True)))
        generated = [i for e in events for i in getattr(e, "ids", [])]
        end = events[-1]
        ends.append({"error": end.message} if isinstance(end, Error) else {"cached": end.usage["cached_tokens"]})
        assert isinstance(end, Done | Error) and sum(isinstance(e, Done | Error) for e in events) == 1
    world.publish(None)
    return ends


@pytest.mark.parametrize("how, check_ranks", [("restore", False), ("chunk", True)])
def test_a_follower_that_leaves_the_plan_is_named_with_both_ranks_plans_and_the_service_goes_on(tmp_path, how,
                                                                                                 check_ranks):
    ends = call("tests.test_rank_plans:diverging_follower", tmp_path, timeout=240, how=how, check_ranks=check_ranks,
                seed=random.randrange(1 << 30))[0]
    first, diverged, again = ends
    assert first == {"cached": 0}, ends
    message = diverged.get("error", "")
    assert "ranks diverged" in message and "rank 0 " in message and "rank 2 " in message, ends
    if how == "restore":  # the agreement after every restore: both plans as carried out
        assert "Restore(how='keep', landed=15" in message and "Restore(how='empty', landed=0" in message, message
    else:  # --check-ranks: the first collective whose call differs, on both ranks, and their plans
        assert "float64[8, " in message and "float64[3, " in message, message
        assert message.count("Restore(how='keep', landed=15") == 2, message
    assert again["cached"] == 11, ends  # every rank restored A from its prefix cache, by rank 0's plan
