"""Chat messages -> prompt text, by the checkpoint's `chat_template` (tokenizer_config.json) when it has one,
else a plain `role: content` transcript ending with `assistant:`."""

import json
from pathlib import Path


def render_chat(messages: list[dict], model_dir: Path | None) -> str:
    cfg_path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    if cfg_path is not None and cfg_path.is_file():
        template = json.loads(cfg_path.read_text()).get("chat_template")
        if template:
            import jinja2

            env = jinja2.Environment(undefined=jinja2.StrictUndefined)
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token="", eos_token="")
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
