"""What the prose of the house cites exists: every repository path (`kernels/linear.py`) and every module or
attribute (`kernels.sampling`, `appliance.measure.costmodel.LAUNCH_S`) that a docstring, a comment or a
string of the code, the README or BENCHMARKS names. A file moved or renamed leaves its citations behind;
this finds them. And the facts kept in two places because one side may not import the other agree."""

import importlib
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROSE = ("README.md", "BENCHMARKS.md")
CODE = ("appliance", "kernels", "graphs", "server", "tests", "scripts")
# a path inside the repository, not part of a longer one (/etc/systemd/system/...)
PATH = re.compile(r"(?<![\w/.-])((?:appliance|kernels|graphs|server|tests|scripts|systemd)/[\w/.-]*\w"
                  r"\.(?:py|sh|md|json|service|toml|env))\b")
# a dotted module or attribute of our packages, not a file name or a call
DOTTED = re.compile(r"(?<![\w/.-])((?:appliance|kernels|graphs|server)(?:\.[A-Za-z_]\w*)+)(?![\w/(-])")
FILE_SUFFIXES = (".py", ".sh", ".md", ".json", ".service", ".toml", ".env")


def prose(path: Path) -> str:
    """A file's text that is prose: all of a Markdown or shell file; a Python file's comments and strings."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    # an f-string's fields are code (`{server.port}`), not prose
    return "\n".join(re.sub(r"\{[^{}]*\}", "", t.string) if t.string[:2].lower() in ("f'", 'f"', "rf", "fr") else
                     t.string for t in tokens if t.type in (tokenize.COMMENT, tokenize.STRING))


def resolves(name: str) -> bool:
    """Whether a dotted name is a module of ours, or an attribute path inside one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a parent that is a module, not a package: an attribute further on
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_citations() -> list[str]:
    files = [ROOT / p for p in PROSE] + sorted(p for d in CODE for p in (ROOT / d).rglob("*")
                                                 if p.suffix in (".py", ".sh", ".md") and p.name != Path(__file__).name)
    stale = []
    for f in files:
        text = prose(f)
        where = f.relative_to(ROOT)
        stale += [f"{where}: {m}" for m in PATH.findall(text) if not (ROOT / m).exists()]
        stale += [f"{where}: {m}" for m in {m.rstrip(".") for m in DOTTED.findall(text)}
                  if not m.endswith(FILE_SUFFIXES) and not resolves(m)]
    return sorted(set(stale))


def test_every_cited_path_and_module_exists():
    assert stale_citations() == []


def test_the_checker_finds_a_moved_file_and_a_missing_module(tmp_path, monkeypatch):
    note = tmp_path / "tests" / "note.md"
    note.parent.mkdir()
    note.write_text("see appliance/cycle.py and kernels.acceptance; kernels/linear.py and kernels.sampling hold\n")
    for d in ("appliance", "kernels"):
        (tmp_path / d).mkdir()
    (tmp_path / "kernels" / "linear.py").write_text("")
    for p in PROSE:
        (tmp_path / p).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert stale_citations() == ["tests/note.md: appliance/cycle.py", "tests/note.md: kernels.acceptance"]


def test_the_longest_chunk_is_the_kernels_largest_launch():
    """appliance/options.py may not import the kernels (no torch in the front objects): its bound on --chunk
    restates kernels/_triton.py's MAX_ROWS."""
    from appliance.options import MAX_CHUNK
    from kernels._triton import MAX_ROWS

    assert MAX_CHUNK == MAX_ROWS
