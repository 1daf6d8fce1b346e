"""The structure the design asks for, read from the code's own imports (every import, deferred and TYPE_CHECKING ones too).

- the core knows no backend: nothing in kestrel_core imports a backend, a plugin package or the kernels;
- no import circles in kestrel_core;
- the runner imports no engine (the run is built above it, from narrow inputs), and the window reads no plugin manager;
- no module loads under two names.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "kestrel_core"
OUTSIDE = ("backends", "plugins", "csrc",
           "bench")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a file or package of this tree."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, wherever the import sits in the file."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # ``from . import plugins`` (or ``from kestrel_core import plugins``) imports the module, not the face
            if node.module and not all(is_module(f"{stem}.{a.name}") for a in node.names):
                found.add(stem)
            found.update(f"{stem}.{a.name}" for a in node.names)
    return found


def core_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in CORE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_the_core_imports_no_backend_and_no_plugin_package():
    offenders = {}
    for path in CORE.rglob("*.py"):
        bad = sorted(m for m in imports_of(path) if m.split(".")[0] in OUTSIDE)
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, f"the core imports what plugs into it: {offenders}"


def test_the_core_holds_no_host_tier_module():
    names = {p.stem for p in CORE.rglob("*.py")}
    assert not names & {"host_tier", "staging", "diskread", "pagecache", "pinned_arena", "budget"}


def test_the_core_has_no_import_circle():
    graph = core_graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, f"import circles in kestrel_core: {circles}"


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_runner_imports_no_engine_and_the_window_no_plugin_manager():
    graph = core_graph()
    assert "kestrel_core.engine.run" not in reach(graph, "kestrel_core.engine.runner")
    assert "kestrel_core.plugins" not in reach(graph, "kestrel_core.engine.residency")
    assert "kestrel_core.plugins" not in reach(graph, "kestrel_core.engine.runner")


def test_the_token_loop_has_one_home():
    """generate.py and decode.py are gone: the runner owns the step, and there is one layer loop in it."""
    assert not (CORE / "generate.py").exists() and not (CORE / "decode.py").exists()
    tree = ast.parse((CORE / "engine" / "runner.py").read_text())
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and "boundaries" in ast.unparse(n.iter)]
    assert len(loops) == 1, [ast.unparse(n.iter) for n in loops]


def test_every_file_loads_under_one_name_its_path():
    """Every built-in loaded through the entry points, and each file of the tree in sys.modules once, under the name
    its path gives (``backends/cuda/backend.py`` is ``backends.cuda.backend``)."""
    import sys

    from kestrel_core import plugins

    plugins.load_plugins()
    importlib.import_module("plugins.gates")
    names: dict[Path, list[str]] = {}
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        path = Path(file).resolve() if file and Path(file).is_absolute() else Path("/")
        if ROOT in path.parents and path.relative_to(ROOT).parts[0] in ("kestrel_core", "backends", "plugins", "csrc"):
            names.setdefault(path, []).append(name)
    assert names and all(v == [module_name(p)] for p, v in names.items()), \
        {str(p.relative_to(ROOT)): v for p, v in names.items() if v != [module_name(p)]}
    assert {"backends.cuda", "backends.cpu_ref", "plugins.gates", "plugins.drafters"} <= set(sys.modules)


def test_nothing_calls_a_private_token_loop():
    """One door: the sweep, the gates, the bench and the tests generate through Run.generate."""
    offenders = []
    for path in [*ROOT.glob("kestrel_core/**/*.py"), *ROOT.glob("plugins/**/*.py"), *ROOT.glob("bench/**/*.py"),
                 *ROOT.glob("tests/*.py")]:
        text = path.read_text()
        if "kestrel_core.generate" in text or "kestrel_core.decode" in text or "open_run(" in text:
            if path.name != "test_architecture.py":
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


RUNNER_STEPS = {"step", "read", "place", "park", "open_slots"}  # what only the token loop (batch.py) asks a runner


def runner_calls(path: Path) -> list[str]:
    """Calls in ``path`` of a runner's step methods (``runner.step(...)``, ``self.run.runner.read(...)``)."""
    return [ast.unparse(n) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in RUNNER_STEPS
            and "runner" in ast.unparse(n.func.value)]


ENGINE_DOORS = ("kestrel_core.load", "kestrel_core.engine.run", "kestrel_core.engine.runner", "kestrel_core.engine.batch")


def opens_a_run(path: Path) -> list[str]:
    """What in ``path`` loads a model or opens a run: an import of ``load`` or the runner, or a call of ``.open(...)``."""
    tree, found = ast.parse(path.read_text()), []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            found += [m for m in [n.module, *(f"{n.module}.{a.name}" for a in n.names)] if m in ENGINE_DOORS]
        elif isinstance(n, ast.Import):
            found += [a.name for a in n.names if a.name in ENGINE_DOORS]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "open":
            found.append(ast.unparse(n))
    return found


def test_no_plugin_steps_a_runner_or_opens_a_run():
    """A drafter drafts through the draft run the engine opens for it (``engine/draft_run.py``), whose proposals go
    through a Batch: no plugin calls Runner.step or Runner.read, nor opens a run of its own behind the engine's back."""
    plugin_files = sorted((ROOT / "plugins").rglob("*.py"))
    assert ROOT / "plugins" / "drafters.py" in plugin_files
    calls = {str(p.relative_to(ROOT)): runner_calls(p) for p in plugin_files}
    assert not any(calls.values()), {k: v for k, v in calls.items() if v}
    opens = opens_a_run(ROOT / "plugins" / "drafters.py")
    assert not opens, opens


def test_the_runner_check_finds_what_the_old_drafter_did(tmp_path):
    """The checks above catch a drafter that steps its own runner and opens its own run (as plugins/drafters.py did)."""
    old = tmp_path / "old_drafter.py"
    old.write_text("from kestrel_core import load\nfrom kestrel_core.engine.runner import StepRequest\n"
                   "def propose(self):\n    runner = self.run.runner\n    self.run = load('x').open(keep='off')\n"
                   "    launched = runner.step(self.slots, StepRequest(1))\n"
                   "    return self.run.runner.read(self.slots, launched, hear=(0,))\n")
    assert runner_calls(old) == ["runner.step(self.slots, StepRequest(1))",
                                 "self.run.runner.read(self.slots, launched, hear=(0,))"]
    assert "kestrel_core.load" in opens_a_run(old) and "kestrel_core.engine.runner" in opens_a_run(old)
    assert any(".open(" in x for x in opens_a_run(old))
