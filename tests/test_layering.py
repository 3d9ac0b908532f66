"""The import rules of the house (README, Layout), read from the source with `ast` (imports inside functions
count too): which wing may import which, no import circles, and the one upward arrow (appliance/cli ->
server). Also the one chat request: typed from the API edge to the chat encoder, never rebuilt as a body;
and the line budgets of every wing, module and function."""

import ast
import inspect
import typing
from pathlib import Path

from appliance.api import ChatRequest, Request
from appliance.chat import encode_request

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "kernels", "graphs", "server")

# what each part of the tree may import of ours (a module always may import inside its own wing)
ALLOWED = {
    "kernels": set(),
    "graphs": set(),
    "appliance.errors": set(),
    "appliance.api": {"appliance.errors"},
    "appliance.options": {"appliance.errors"},
    "appliance.chat": {"appliance.errors", "appliance.api"},  # api: the ChatRequest it encodes, roles, limits
    "appliance.model": {"appliance.errors", "kernels"},
    # kernels: the sums over ranks are a kernel's (kernels/rank_sum.py), launched by the collectives
    "appliance.parallel": {"appliance.errors", "appliance.model", "kernels"},
    "appliance.decode": {"appliance.api", "appliance.errors", "appliance.options", "appliance.model",
                         "appliance.chat", "graphs", "kernels"},
    # parallel: the measure wing builds split models from a config (shapes.py) with the real split
    "appliance.measure": {"appliance.api", "appliance.errors", "appliance.model", "appliance.parallel",
                          "appliance.chat", "kernels"},
    "appliance.loader": {"appliance.errors", "appliance.options", "appliance.model", "appliance.parallel",
                         "kernels"},
    "appliance.engine": {"appliance.api", "appliance.errors", "appliance.options", "appliance.loader",
                         "appliance.decode", "appliance.measure", "appliance.parallel"},
    "appliance.cli": {"appliance", "kernels", "graphs", "server"},
    "appliance": {"appliance.cli"},  # __init__ / __main__
    "server": {"appliance.api", "appliance.errors", "appliance.chat"},  # chat: pure Python request fields
}
NO_TORCH = ("server", "appliance.api", "appliance.errors", "appliance.options", "appliance.chat")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every module `name` imports (absolute names, relative imports resolved), at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def ours(graph_modules: dict[str, Path], target: str) -> str | None:
    """The module of ours `target` names (a module, or the module of an imported attribute), if any."""
    while target and target not in graph_modules:
        target = target.rpartition(".")[0]
    return target or None


def part_of(name: str) -> str:
    """The most specific key of ALLOWED that `name` falls under."""
    keys = [k for k in ALLOWED if name == k or name.startswith(k + ".")]
    return max(keys, key=len)


def wing(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "appliance" and len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        targets = {ours(mods, t) for t in imports_of(name, path)}
        edges[name] = {t for t in targets if t is not None and t != name}
    return edges


def forbidden_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, targets in edges.items():
        allowed = ALLOWED[part_of(name)]
        for t in targets:
            if wing(t) == wing(name) or any(t == a or t.startswith(a + ".") for a in allowed):
                continue
            bad.append(f"{name} imports {t} ({part_of(name)} may import: {', '.join(sorted(allowed)) or 'nothing'})")
    return sorted(bad)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between modules (a module that imports its own package's __init__ excepted: Python
    runs the package first, which is no circle)."""
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for t in sorted(edges.get(n, ())):
            if n.startswith(t + "."):
                continue
            if state.get(t) == "open":
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_every_wing_imports_only_what_the_layout_allows():
    assert forbidden_imports(graph()) == []


def test_the_model_wing_imports_nothing_of_the_chat_wing():
    """What a checkpoint computes knows no chat encoding: the tiny checkpoints, whose tokenizer carries the chat
    tokens, are written beside the CLI (appliance/cli/tiny_checkpoint.py)."""
    edges = graph()
    into_chat = [f"{n} -> {t}" for n in sorted(edges) if wing(n) == "appliance.model"
                 for t in sorted(edges[n]) if wing(t) == "appliance.chat"]
    assert into_chat == []


def test_there_are_no_import_circles():
    assert circles(graph()) == []


def test_the_one_upward_arrow_is_the_cli_starting_the_server():
    edges = graph()
    into_server = {n for n, ts in edges.items() if wing(n) != "server" and any(wing(t) == "server" for t in ts)}
    assert into_server and all(n.startswith("appliance.cli") for n in into_server), into_server


def test_the_server_and_the_front_objects_never_import_torch():
    mods = modules()
    for name, path in mods.items():
        if part_of(name) in NO_TORCH or name.startswith("server"):
            heavy = {i for i in imports_of(name, path) if i.split(".")[0] in ("torch", "triton", "numpy")}
            assert not heavy, f"{name} imports {sorted(heavy)}"


# Line budgets (lines of source, comments and docstrings included): a package's whole, any module, any function.
# Kernels get more: a Triton kernel and its launcher carry long argument lists. Raising a budget is a decision
# made here, with its reason; the request loop has its own, tighter one below. Kernels 5,500 -> 5,550: the
# indexer's block maxima (a prefill chunk's scores never stored whole), a mode of the scores kernel and its
# reference. 5,550 -> 5,560: a long call's rows take a split shared expert whole (kernels/moe.py
# `_own_shared`: its partials no longer cross the links), the experts' launches one function for both.
# 5,560 -> 5,640: a long call's products in the checkpoint's formats beside plain ones launched apart
# (kernels/linear.py `native_split`), its shared expert in launches of its own on one device too, and the router
# a module of its own (kernels/router.py: its header), so kernels/moe.py keeps its 900. 5,640 -> 5,730: every
# kernel launched dependent on the one ahead (its PDL constexpr, its first statement, the launch's options and
# their imports: about four lines a kernel; kernels/_triton.py `pdl`, `dependent_launch`). 5,730 -> 5,750: its
# switch read once (`dependent_launches`), and which products can multiply in the checkpoint's formats said in
# one place (kernels/linear.py `in_native_formats`, for the kernels and the count; appliance/ had its own copy).
# 5,750 -> 5,850: a verify's acceptance, counter and result in three launches (kernels/sampling.py
# `_accept_kernel`: the residual draws of every row and the last program's tests), not ~80 torch operations.
# 5,850 -> 5,900: the sums over ranks inside their consumers (kernels/rank_sum.py `rank_load`; the mHC expand and
# the MoE's combine take the ranks' partials as a tuple of pointers): two launches a layer fewer. 5,900 -> 6,110:
# the sums over symmetric memory without barriers or launches of their own (kernels/rank_sum.py: `Publish`,
# `publish_slot` and `rank_publish`, the producers' slot and count-in, taken by the linear and MoE down
# kernels; `rank_arrive`, the consumers' wait inside their kernels; the slots' arithmetic). 6,110 -> 6,180: the
# attention's expand inside the next site's launch. 6,180 -> 6,260: DSpark's stage keys in one launch
# (kernels/attn_inputs.py `window_keys`, its reference, checks and kernel). 6,260 -> 6,340: the MoE's combine
# inside the next site's launch (kernels/mhc.py `Combine`, `output_row` and `expand_tile`, the MoE's combine
# taking the same device functions; the site's columns split by d). 6,340 -> 6,420: the interpreter's shared
# block types and unbroadcast equal shapes (kernels/_interpreter_speed.py: ~25% of an interpreted forward's CPU,
# the suite's largest cost, which CI ran past 25 minutes), and the int32 offsets' bound in one helper. 6,420 ->
# 6,480: DSpark's Markov step in the sampler's launch (kernels/sampling.py `sample_sum`, its reference, checks
# and the kernel's sum and gather): a Markov step's gather, add and draw in one launch. 6,480 -> 6,570: the
# interpreter's binary type checks planned once per pair of types, and its builtins listed once and called
# directly (kernels/_interpreter_speed.py; the suite, still over 25 minutes in CI, is mostly the interpreter's
# Python). 6,570 -> 6,650: the interpreter's broadcasts and new axes planned once per pair of types, a number's
# checked scalar made once per value (~25% of an interpreted forward's CPU; CI still past 25 minutes). 6,650 ->
# 6,690: the interpreter's float conversions looked up in tables (a fourth of an interpreted prefill's CPU in
# the checkpoint's formats; CI at 1,499 s, on the 25 minutes). 6,690 -> 6,740: a decode step's MoE rows summed
# in its down launch before the sum over ranks (kernels/moe.py `_row_sums`, `_row_sums_into`, `unit_rows`): two
# rows a token over the links where seven travelled. 6,740 -> 6,820: an Engram layer's wkv split by outputs
# over ranks in a decode step (kernels/engram.py `_gates_kernel`, `_kv_tile`, the product's launch apart): a
# quarter of its 157 MB a rank. 6,820 -> 6,940: a cycle's logits read by the samplers where the ranks hold them
# (kernels/sampling.py `SplitLogits`, `_fill_row`, `_gathered` and the samplers' fill arguments): no all-gather
# and no concatenation of the logits in a cycle. 6,940 -> 7,060: a forward's token inputs in one launch
# (kernels/embed.py: the history write and the embedding rows' copies, two torch launches before). Appliance
# 13,600 -> 13,670: a DSpark draft reads its q's key row where its verify left it (appliance/decode/
# speculator.py `ahead`, `catch_up`, `cycled`, `truncate`): three launches and a torch launch a cycle fewer;
# and the count's declared reads of the token inputs (appliance/measure/count.py `_token_inputs`). Kernels
# 7,060 -> 7,160, appliance 13,670 -> 13,745: the k=3 cycle's five torch launches outside the layers folded into
# the launches beside them or made one of ours (a product into a caller's buffer, a second table's rows with
# the token inputs, a site's mean and collapse into views of wider rows, rows into a ring's slots:
# kernels/linear.py, embed.py, mhc.py, ring_rows.py), the last MoE's combine in the head's collapse (kernels/
# mhc.py, moe.py `Pending.rows`, appliance/model/deepseek_v41.py `final_collapse`), DSpark's base logits through
# an exchange of their own (parallel/sharding.py `Comm.gather_later`, kernels/sampling.py `B_WAIT`): an
# all-gather a cycle fewer; the acceptance's gather in its own launch (`_gathered` went). Kernels 7,160 -> 7,380,
# appliance 13,745 -> 13,765: an attention's row work in the launch of its query products (kernels/
# query_inputs.py; attn_inputs.py `rope_tile`, `key_rows`, `QueryRows`; linear.py's ROWS; the count's
# `_query_inputs`; its benchmark case, which the compile check takes at V4.1's shapes): a launch a layer fewer.
# Kernels 7,380 -> 7,630, appliance 13,765 -> 13,790: dependent phases in one launch (kernels/phases.py, its
# chain and the device check's measure of its wait, appliance/measure/bench.py `measure_phase_wait`); a decode
# step's router, gate and up, and down as phases of one launch (kernels/moe.py `_step_kernel`, the three
# kernels' bodies as device functions of their program ids, router.py `route_program`; the count's and the
# cost model's phase waits): two launches a layer fewer.
PACKAGE_LINES = {"appliance": 13_790, "kernels": 7_630, "server": 4_600, "graphs": 200}
MODULE_LINES = {"kernels": 900, "appliance": 600, "server": 600, "graphs": 200}
FUNCTION_LINES = {"kernels": 140, "appliance": 90, "server": 90, "graphs": 90}


def over_budget(name: str, source: str, package: str | None = None) -> list[str]:
    """What of module `name` (its source) is longer than its package (by default its name's first part)
    allows."""
    w = package or name.split(".")[0]
    lines = source.splitlines()
    found = [f"{name}: {len(lines)} lines > {MODULE_LINES[w]}"] if len(lines) > MODULE_LINES[w] else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > FUNCTION_LINES[w]:
                found.append(f"{name}.{node.name} (line {node.lineno}): {n} lines > {FUNCTION_LINES[w]}")
    return found


def test_every_package_module_and_function_keeps_its_line_budget():
    totals = dict.fromkeys(PACKAGE_LINES, 0)
    found = []
    for name, path in modules().items():
        source = path.read_text()
        totals[name.split(".")[0]] += len(source.splitlines())
        found += over_budget(name, source)
    found += [f"{w}: {n} lines > {PACKAGE_LINES[w]}" for w, n in totals.items() if n > PACKAGE_LINES[w]]
    assert not found, "\n".join(found)


def test_the_budget_sees_a_long_module_and_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(95))
    assert over_budget("probe", f"def f():\n{body}\n", "appliance") == ["probe.f (line 1): 96 lines > 90"]
    assert over_budget("probe", f"def f():\n{body}\n", "kernels") == []
    assert over_budget("probe", "pass\n" * 601, "server") == ["probe: 601 lines > 600"]


def test_the_request_loop_is_short_and_knows_no_kernels_or_graphs():
    mods = modules()
    path = mods["appliance.decode.loop"]
    assert len(path.read_text().splitlines()) < 250
    assert not {t for t in graph()["appliance.decode.loop"] if wing(t) in ("kernels", "graphs")}


def test_the_checker_sees_a_forbidden_import_and_a_circle():
    edges = graph()
    edges["appliance.model.state"] = edges["appliance.model.state"] | {"appliance.decode.session",
                                                                       "appliance.model.blocks"}
    assert any(b.startswith("appliance.model.state imports appliance.decode.session") for b in forbidden_imports(edges))
    assert ["appliance.model.blocks", "appliance.model.state", "appliance.model.blocks"] in circles(edges)


# Where a chat request travels from the wire to the chat encoder: the API edges and the rest of the server, the
# engine, the request loop. server.probe is a client of the server: it writes bodies to send.
CHAT_PATH = ("server", "appliance.engine", "appliance.decode")
OFF_THE_PATH = ("server.probe",)


def under(name: str, parts: tuple) -> bool:
    return any(name == p or name.startswith(p + ".") for p in parts)


def rebuilt_bodies(source: str) -> list[int]:
    """Lines of `source` that build a dict with a "messages" key (a literal, or dict(messages=...)): a chat
    request turned back into a body for the encoder to parse again."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "messages"
                                              for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" \
                and any(k.arg == "messages" for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_a_chat_request_reaches_the_encoder_as_the_api_edge_built_it():
    """The edge builds one ChatRequest, the Request carries it, the encoder takes it; nothing on the way turns
    it back into a {"messages": ...} body."""
    first = next(iter(inspect.signature(encode_request).parameters.values()))
    assert first.annotation is ChatRequest, f"encode_request takes {first.name}: {first.annotation}"
    assert typing.get_type_hints(Request)["chat"] == ChatRequest | None
    on_the_way = [n for n in modules() if under(n, CHAT_PATH) and not under(n, OFF_THE_PATH)]
    assert "appliance.decode.chat" in on_the_way
    bodies = {n: rebuilt_bodies(modules()[n].read_text()) for n in on_the_way}
    assert {n: lines for n, lines in bodies.items() if lines} == {}


def test_the_checker_sees_a_chat_body_rebuilt():
    assert rebuilt_bodies('body = {"messages": req.chat.messages, "tools": None}\nx = {"tools": 1}') == [1]
    assert rebuilt_bodies("f(1)\nbody = dict(messages=m)") == [2]
