"""An Engine whose model writes what the test says: the seam for tests of the HTTP API.

Everything but the model is real: the Engine thread, the request loop (validation, the chat encoding in the
checkpoint's dialect, tokenization, stop strings, the streaming output parser) and the embedded model's
tokenizer. Only the decode session is a stand-in: `ScriptedSession` returns the ids of a scripted output
text instead of sampling, keeps the prompt of the previous request as its "cached prefix" (so
`cached_tokens` means what it means on the real session), and can be slowed per prefill chunk or per token
so a test can disconnect or cancel in the middle.

    engine, session = scripted_engine()
    session.script("Some reasoning</think>The answer.")      # then EOS, as the model ends a turn
    ... a client talks to an App serving `engine` ...
    session.prompts[-1]                                       # the ids the request loop sent to the model
"""

import collections
import random
import threading
import time

from appliance.api import Sampling
from appliance.chat.dialects import EOS
from appliance.decode.loop import RequestLoop
from appliance.decode.plan import Steer
from appliance.decode.session import Prefilled, Restored, Sampled
from appliance.engine import Engine, EngineInfo
from appliance.loader import default_model_dir
from appliance.model.config import load_config
from appliance.model.tokenizer import load_tokenizer


class ScriptedSession:
    """The DecodeSession calls the request loop makes (plan, run, stop, reset, restored), answered from
    scripts: `run` goes through a job's steps as the real session does, asking its steer before each prefill
    chunk and each cycle."""

    def __init__(self, cfg, tokenizer, capacity: int = 4096, chunk: int = 16):
        self.cfg, self.tokenizer, self.capacity, self.chunk = cfg, tokenizer, capacity, chunk
        self.world = self.spec = self.stats = None
        self.scripts: collections.deque[list[int]] = collections.deque()
        self.state: list[int] = []  # the ids the "decode state" holds
        self.prompts: list[list[int]] = []
        self.samplings: list = []
        self.token_delay_s = 0.0
        self.chunk_delay_s = 0.0
        self.cycles = 0  # decode cycles run, over all requests
        self.chunks = 0  # prefill chunks run, over all requests
        self.lock = threading.Lock()
        self._out: list[int] = []
        self.cached = 0  # what the last restore kept
        self._steer: Steer | None = None  # the running job's

    def script(self, text: str, eos: bool = True) -> list[int]:
        """The model's next output: `text` (special tokens as single ids), then EOS unless `eos` is False."""
        ids = self.tokenizer.encode(text + (EOS if eos else ""))
        self.scripts.append(ids)
        return ids

    def prompt_text(self, k: int = -1) -> str:
        return self.tokenizer.decode(self.prompts[k])

    # --- what the request loop calls ---

    def plan(self, ids: list[int]) -> None:
        return None  # the stand-in keeps the common prefix with its last prompt, decided in `run`

    @property
    def restored(self) -> dict:
        n = self.cached
        return {"source": "device" if n else "none", "matched_tokens": n, "cached_tokens": n}

    def run(self, job):
        self._steer = Steer()
        return self._steps(job, self._steer)

    def stop(self) -> None:
        self._steer.stop()

    def _steps(self, job, steer):
        ids = list(job.ids)
        common = 0
        while common < min(len(ids) - 1, len(self.state)) and ids[common] == self.state[common]:
            common += 1
        self.state = self.state[:common]
        self.cached = common
        self.prompts.append(ids)
        self.samplings.append(Sampling(job.temperature, job.top_p, job.top_k, job.seed))
        yield Restored(common)
        while len(self.state) < len(ids):
            if not steer.proceed():
                return
            time.sleep(self.chunk_delay_s)
            self.state = ids[:len(self.state) + self.chunk]
            self.chunks += 1
            yield Prefilled(len(self.state))
        self._out = self.scripts.popleft() if self.scripts else [self.cfg.eos_token_id]
        tokens = [self._next()]
        yield Sampled(tokens)
        while steer.proceed():
            time.sleep(self.token_delay_s)
            self.cycles += 1
            self.state.append(tokens[-1])
            tokens = [self._next()]
            yield Sampled(tokens)

    def _next(self) -> int:
        return self._out.pop(0) if self._out else self.cfg.eos_token_id

    def reset(self) -> None:
        self.state = []


def scripted_engine(capacity: int = 4096) -> tuple[Engine, ScriptedSession]:
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    session = ScriptedSession(cfg, tokenizer, capacity)
    info = EngineInfo("scripted", cfg.family, capacity, cfg.vocab_size, "none", "cpu")
    return Engine(RequestLoop(session, tokenizer, model_dir), info, warmup=False), session


_rng = random.Random()


def words(n: int = 4) -> str:
    """n random lowercase words: a prompt the scripted model does not read."""
    return " ".join("".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(2, 8)))
                    for _ in range(n))


def scripted_box():
    """For a module fixture: (an in-process server with the token, its scripted session); stops it after."""
    from tests.server_harness import TOKEN, InProcessServer

    engine, session = scripted_engine()
    server = InProcessServer(engine, token=TOKEN)
    yield server, session
    assert server.stop() == 0
