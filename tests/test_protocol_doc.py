"""server/PROTOCOL.md is decode.v1's specification: every frame type, error code and close code that
server/protocol.py defines is documented there. The constants are read from the module's source (ast), so a
frame type written as a literal in a new frame builder counts too."""

import ast
import re
from pathlib import Path

from server import protocol as proto

SERVER = Path(__file__).resolve().parent.parent / "server"
SPEC = (SERVER / "PROTOCOL.md").read_text()
SOURCE = ast.parse((SERVER / "protocol.py").read_text())


def _module_constants() -> dict:
    out = {}
    for node in SOURCE.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _frame_type_literals() -> set[str]:
    """Every {"type": "<literal>", ...} dict in protocol.py: the frames it builds."""
    found = set()
    for node in ast.walk(SOURCE):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "type" and isinstance(v, ast.Constant):
                    found.add(v.value)
    return found


CONSTANTS = _module_constants()
CLOSE_CODES = {name: code for name, code in CONSTANTS.items() if name.startswith("CLOSE_")}


def test_the_spec_lives_beside_the_code_and_the_module_points_to_it():
    assert "server/PROTOCOL.md" in proto.__doc__
    assert "server/PROTOCOL.md" in (SERVER.parent / "README.md").read_text()


def test_every_frame_type_the_code_defines_or_builds_is_documented_as_a_frame():
    server_types = set(CONSTANTS["SERVER_FRAME_TYPES"])
    built = _frame_type_literals() - {"invalid_request_error"}
    assert built <= server_types, f"frames built but not in SERVER_FRAME_TYPES: {built - server_types}"
    for kind in server_types | set(CONSTANTS["CLIENT_FRAME_TYPES"]):
        assert re.search(rf"^- `{kind}`:", SPEC, re.M), f"frame type {kind!r} has no entry in PROTOCOL.md"


def test_every_error_code_and_its_type_are_documented():
    for code, kind in CONSTANTS["ERROR_TYPES"].items():
        assert f"`{code}` (`{kind}`" in SPEC, f"error code {code!r} ({kind}) is not documented in PROTOCOL.md"


def test_every_close_code_the_code_defines_is_documented():
    assert len(CLOSE_CODES) >= 10 and CLOSE_CODES["CLOSE_IDLE"] == 4408
    section = SPEC.split("## Close codes", 1)[1].split("\n## ", 1)[0]
    for name, code in CLOSE_CODES.items():
        assert re.search(rf"^- {code} ", section, re.M), f"{name} = {code} is not documented in PROTOCOL.md"
