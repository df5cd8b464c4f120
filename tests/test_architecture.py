"""The package's imports point one way (see docs/architecture.md): no cycles, no import of a
higher layer, no llmbatch import hidden inside a function, no module past its size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llmbatch"
#: Lowest first. A module may import its own layer (without a cycle) and the ones below.
LAYERS = [
    ["errors", "env", "rows", "params", "redact", "codec", "startlog"],
    ["io", "openai", "models", "toy_models", "engines", "progress", "reaper", "sample_data", "sample_images", "sample_audio",
     "install_check", "cluster", "watchdog", "terminal", "report", "model_names"],
    ["config", "resume", "validation", "stages"],
    ["placement", "processor", "builders", "deployments"],
    ["jobs", "demo"],
    ["cli", "server", "__init__", "__main__"],
]
#: Modules allowed past MAX_LINES, and why (the same reasons are on the architecture page).
LONG_MODULES = {"config": "every user-facing setting with its documentation, on one page"}
#: llmbatch imports allowed inside a function, and why: (importing module, imported module).
LAZY_IMPORTS = {("cli.serve", "server.main"): "FastAPI & co. (the serve extra) load only when `llmbatch serve` runs",
                ("cli.serve", "server.settings"): "imported beside server.main, when `llmbatch serve` runs",
                **dict.fromkeys((("cli", "cli.jobs"), ("cli", "cli.getting_started"), ("cli", "cli.serve"),
                                 ("cli", "cli.base")),
                                "the commands' imports (Ray, pyarrow, the config layer) come after the start of "
                                "a job's engine launcher (engines.vllm_early.prewarm), which imports vLLM beside them")}
#: A cap per concept, not a size to split by: a module owns one thing, and one thing fits in this.
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"module {module} is in no layer: add it to LAYERS and docs/architecture.md")


def imports(path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported llmbatch module, inside a function, line) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names = []
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("llmbatch"):
                base = child.module.removeprefix("llmbatch").lstrip(".")
                for alias in child.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    names.append(full if full in known else base)
            elif isinstance(child, ast.Import):
                names = [a.name.removeprefix("llmbatch.") for a in child.names if a.name.startswith("llmbatch.")]
            for name in names:
                if name:
                    found.append((name, in_function, child.lineno))
            visit(child, nested)

    visit(tree, False)
    return found


def graph() -> dict[str, list[tuple[str, bool, int]]]:
    mods = modules()
    return {name: imports(path, set(mods)) for name, path in mods.items()}


def test_no_import_goes_up_a_layer():
    wrong = [f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)}) at line {line}"
             for m, deps in graph().items() for i, _, line in deps if layer_of(i) > layer_of(m)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    g = {m: {i for i, _, _ in deps if i != m} for m, deps in graph().items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, path + [nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(g):
        if state.get(start) is None and visit(start, [start]):
            break
    assert not cycle, " -> ".join(cycle)


def test_no_llmbatch_import_inside_a_function():
    inside = [f"{m}:{line} imports {i}" for m, deps in graph().items() for i, nested, line in deps
              if nested and (m, i) not in LAZY_IMPORTS]
    assert not inside, "import it at the top of the module:\n" + "\n".join(inside)


def test_no_llmbatch_module_is_imported_by_name():
    """``importlib.import_module("llmbatch...")`` would hide an import from the tests above."""
    found = [f"{name}:{node.lineno}" for name, path in modules().items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                                   and a.value.startswith("llmbatch") for a in node.args)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"]
    assert not found, f"import these plainly (a lazy one goes in LAZY_IMPORTS): {found}"


#: What makes an OpenAI wire object: an endpoint's path, a response object's name, an id prefix.
WIRE_WORDS = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "chat.completion", "chat.completion.chunk",
              "text_completion", "batch_req_", "req_", "chatcmpl-", "cmpl-", "embd-"}
#: Key sets that make one: a response (choices or data beside its object name) or a batch output line.
WIRE_SHAPES = ({"object", "choices"}, {"object", "data", "usage"}, {"custom_id", "response"},
               {"custom_id", "error", "id"})


def wire_objects(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each OpenAI wire word or wire-shaped dict literal in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in WIRE_WORDS:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            found += [(node.lineno, f"a dict with keys {sorted(shape)}") for shape in WIRE_SHAPES if shape <= keys]
    return found


def test_only_the_openai_package_builds_openai_wire_objects():
    """Requests, responses and batch lines in OpenAI's shape are built by ``llmbatch.openai``
    alone (they were built twice, and the two copies drifted: one answered choices[0] only)."""
    found = [f"{name}:{line}: {what}" for name, path in sorted(modules().items()) if name.split(".")[0] != "openai"
             for line, what in wire_objects(ast.parse(path.read_text()))]
    assert not found, "use llmbatch.openai (its vocab, requests, responses) instead:\n" + "\n".join(found)


def test_the_wire_check_sees_a_wire_object():
    source = 'def answer(text):\n    return {"object": "chat.completion", "choices": [{"text": text}]}\n'
    assert sorted(what for _, what in wire_objects(ast.parse(source))) == [
        "'chat.completion'", "a dict with keys ['choices', 'object']"]


@pytest.mark.parametrize("name,path", sorted(modules().items()))
def test_modules_stay_small(name, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES or name in LONG_MODULES, (
        f"{name} has {lines} lines, over the cap per concept ({MAX_LINES}): it owns more than one thing; "
        "split it by what it owns, not by size")


def test_the_architecture_page_names_every_top_level_module():
    import re

    page = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    named = {w.strip("/").removesuffix(".py") for w in re.findall(r"`([\w/.]+)`", page)}
    missing = sorted({m.split(".")[0] for m in modules()} - {"__init__", "__main__"} - named)
    assert not missing, f"docs/architecture.md does not mention {missing}"


def test_test_module_names_are_unique():
    """pytest imports test files by basename (no packages under tests/): two files with one
    name break collection of the whole suite, so each name must be unique."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen.setdefault(path.name, path)
    assert not clashes, f"rename one of each pair: {clashes}"



def test_the_files_scheduled_first_exist():
    """suite_schedule.LONGEST_FIRST names test files by path: a renamed file would quietly lose
    its place at the front of ``make test``."""
    from suite_schedule import LONGEST_FIRST

    repo = Path(__file__).resolve().parents[1]
    assert [p for p in LONGEST_FIRST if not (repo / p).is_file()] == []


def test_every_engine_inherits_the_engine_base():
    """The engine seam is one class (engines/base.py): the engine stage calls its hooks plainly,
    so an engine that does not inherit it would miss the defaults."""
    import importlib
    import inspect

    from llmbatch.engines.base import Engine

    loose = []
    for name in sorted(m for m in modules() if m.startswith("engines.")):
        tree = ast.parse(modules()[name].read_text())
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name == "Engine":
                continue
            methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if {"build_request", "run"} <= methods:
                cls = getattr(importlib.import_module(f"llmbatch.{name}"), node.name)
                if not (inspect.isclass(cls) and issubclass(cls, Engine)):
                    loose.append(f"{name}.{node.name}")
    assert not loose, f"inherit llmbatch.engines.base.Engine: {loose}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_used_across_modules():
    """A ``_name`` is its module's own: one that another module needs is public (with a
    docstring) or lives in the module that uses it. Checks ``from llmbatch.x import _y`` and
    ``x._y`` where ``x`` is an imported llmbatch module."""
    mods = modules()
    wrong = []
    for name, path in sorted(mods.items()):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmbatch"):
                base = node.module.removeprefix("llmbatch").lstrip(".")
                for alias in node.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    if full in mods:
                        aliases[alias.asname or alias.name] = full
                    elif is_private(alias.name) and base != name:
                        wrong.append(f"{name}:{node.lineno} imports {alias.name} from {base}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("llmbatch.") and alias.asname:
                        aliases[alias.asname] = alias.name.removeprefix("llmbatch.")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and is_private(node.attr)
                    and aliases.get(node.value.id, name) != name):
                wrong.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "make it public or move it where it is used:\n" + "\n".join(wrong)
