"""A checkpoint's sampling defaults: what a request that names no temperature or top_p gets.

Read from the checkpoint's `generation_config.json` when it has one (its `temperature` and `top_p`, each
where given), else the model card's recommendation in the dialect table (`dialects.py`; spec §5: 1.0 and
1.0 for the whole family). No public copy of these checkpoints ships the file, so both sources matter.
"""

import json
from pathlib import Path

from appliance.api import TEMPERATURE, TOP_P
from appliance.errors import ModelLoadError

from .dialects import Dialect

GENERATION_CONFIG = "generation_config.json"


def sampling_defaults(model_dir, dialect: Dialect) -> dict:
    """{"temperature", "top_p", "source"}: `source` names where each came from, for `appliance info` and
    the server's log."""
    out = {"temperature": dialect.temperature, "top_p": dialect.top_p, "source": "model card"}
    path = Path(model_dir) / GENERATION_CONFIG if model_dir is not None else None
    if path is None or not path.is_file():
        return out
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})", field=GENERATION_CONFIG) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: must be a JSON object", field=GENERATION_CONFIG)
    for name, (lo, hi) in (("temperature", TEMPERATURE), ("top_p", TOP_P)):
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi \
                or (name == "top_p" and value == 0):
            raise ModelLoadError(f"{path}: {name}={value!r}: must be a number in {lo:g}..{hi:g}"
                                 + (" (above 0)" if name == "top_p" else ""), field=name, value=value)
        out[name] = float(value)
        out["source"] = GENERATION_CONFIG
    return out
