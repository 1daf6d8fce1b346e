"""The docs check: every hook, contract and subcommand is documented under docs/, every link resolves,
and every code block of the README (and of the docs pages kestrel keeps) that runs on the CPU is run.

A page is run as a user would follow it: its blocks in order, in one fresh directory with its own
HOME. The README's ``sh`` blocks run in bash, with the installed ``kestrel`` entry point; a docs page's
``sh`` block of plain ``kestrel ...`` lines (each may end in ``> FILE``) runs each line through
``kestrel_core.cli.main``, the entry point's own function, in this process (the suite stays fast),
and any other block in bash. ``python`` blocks are exec'd in one namespace per page; ``toml`` blocks
are parsed; ``text`` blocks (output, layouts) are not run. The HTML comment on the line before a
block changes that:

- ``<!-- docs-test: gpu -->``: needs a CUDA GPU, not run here;
- ``<!-- docs-test: download -->``: needs a downloaded checkpoint (the network), not run;
- ``<!-- docs-test: install -->``: installs packages; ``.ci/run`` runs the README's test command
  verbatim (``tests/test_packaging.py`` checks it) and ``tests/test_cli.py`` runs ``kestrel demo``;
- ``<!-- docs-test: server -->``: starts ``kestrel serve`` (which runs until stopped) or talks to one, not
  run; ``tests/test_serve.py`` drives a server process with the same requests;
- ``<!-- docs-test: file NAME -->``: written to NAME in the page's directory (then imported, or read
  by a later block) instead of being run.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_core import cli, plugins

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose blocks are run. A docs page of another part joins by following the conventions above.
RUN = ["README.md", "docs/cli.md", "docs/plugins.md", "docs/gates.md", "docs/moe.md", "docs/q8.md",
       "docs/backends.md", "docs/performance.md", "docs/decode-graphs.md", "docs/chat.md", "docs/models.md",
       "docs/serve.md", "docs/gguf.md"]
LANGUAGES = {"sh", "python", "toml", "text"}
SKIPS = {"gpu", "download", "install", "server"}
MARKER = re.compile(r"<!-- docs-test: (\S+)(?: (\S+))? -->")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def blocks(path: Path) -> list[dict]:
    """The fenced blocks of a page: line, language, marker (and its argument), code."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        assert j < len(lines), f"{path.name}:{start + 1}: a code block that never closes"
        marker = MARKER.fullmatch(lines[start - 1].strip()) if start else None
        found.append({"line": start + 1, "lang": lang, "marker": marker.group(1) if marker else None,
                      "arg": marker.group(2) if marker else None, "code": "\n".join(lines[start + 1:j]) + "\n"})
        i = j + 1
    return found


def prose(path: Path) -> str:
    """A page without its code blocks."""
    return re.sub(r"^```.*?^```\s*$", "", path.read_text(), flags=re.M | re.S)


def docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


# --- what must be documented ----------------------------------------------------------------------

def hookspecs() -> dict[str, str]:
    """name -> ``name(args)`` for every ``@hookspec`` function of kestrel_core/hookspecs.py, read from its source."""
    tree = ast.parse((ROOT / "kestrel_core" / "hookspecs.py").read_text())
    return {f.name: f"{f.name}({', '.join(a.arg for a in f.args.args)})" for f in tree.body
            if isinstance(f, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "hookspec" for d in f.decorator_list)}


def test_the_hookspecs_are_found():
    assert {"register_backends", "on_layer_advance", "on_experts_routed"} <= set(hookspecs())


@pytest.mark.parametrize("name", sorted(hookspecs()))
def test_every_hook_is_documented_in_docs(name):
    signature = hookspecs()[name]
    assert signature in docs_text(), f"no page under docs/ documents the hook {signature}"
    assert f"`{signature}`" in (DOCS / "plugins.md").read_text(), f"docs/plugins.md has no entry for `{signature}`"


def protocols() -> dict[str, list[str]]:
    """Protocol name -> its members, for every Protocol class of kestrel_core/engine/contracts.py."""
    tree = ast.parse((ROOT / "kestrel_core" / "engine" / "contracts.py").read_text())
    found = {}
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in c.bases):
            found[c.name] = [n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in c.body
                             if isinstance(n, (ast.AnnAssign, ast.FunctionDef))]
    return found


@pytest.mark.parametrize("name", sorted(protocols()))
def test_every_contract_and_its_members_are_in_the_plugin_guide(name):
    guide = (DOCS / "plugins.md").read_text()
    section = re.search(rf"^### `{name}`\n(.*?)(?=^##)", guide, re.M | re.S)
    assert section, f"docs/plugins.md has no section ### `{name}` for the Protocol in kestrel_core/engine/contracts.py"
    missing = [m for m in protocols()[name] if not re.search(rf"`{m}\b", section.group(1))]
    assert not missing, f"docs/plugins.md's {name} section does not name {missing}"


def subcommands() -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {n.replace("_", "-") for n in cli.SUBCOMMANDS} | set(sub.choices)


def test_the_subcommands_are_found():
    assert {"generate", "sweep", "demo", "gate"} <= subcommands()


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_subcommand_is_documented_in_docs(name):
    assert re.search(rf"\bkestrel {re.escape(name)}\b", docs_text()), f"no page under docs/ shows `kestrel {name}`"


# --- links and records ----------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(path), re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path))  # not inside inline code
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img [^>]*src="([^"]+)"', text)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not checked here
        target, _, anchor = link.partition("#")
        dest = (page.parent / target).resolve() if target else page
        if not dest.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{link} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_record_named_is_committed(page):
    text = page.read_text()
    named = set(re.findall(r"bench/results/([\w.\-]+\.(?:json|txt))", text))
    named |= set(re.findall(r"\b([a-z0-9_.\-]+_2026\d{4}(?:T\d{4,6}Z)?(?:_[a-z0-9]+)?\.(?:json|txt))", text))
    named = {n for n in named if not n.startswith(".")}  # bench/results/.stamp.json is the stamp file, no record
    missing = sorted(n for n in named if not (ROOT / "bench" / "results" / n).is_file())
    assert not missing, f"{page.name} names records that are not in bench/results: {missing}"


def test_the_readme_picture_is_drawn_from_the_record_it_names(tmp_path):
    text = README.read_text()
    caption = re.search(r"<!-- bench:headline-picture -->\n(.*?)<!-- /bench -->", text, re.S)
    assert "docs/cost-curve.png" in text and caption, "the README's picture and its caption block"
    out = tmp_path / "curve.png"
    done = subprocess.run([sys.executable, "-m", "bench", "plot", "--out", str(out)], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=120)
    drawn = re.search(r"from bench/results/(\S+\.json)", done.stdout)[1]
    assert f"bench/results/{drawn}" in caption[1], "the caption names the record the picture is drawn from"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the code blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [ROOT / p for p in RUN], ids=lambda p: p.name)
def test_every_block_is_labelled(page):
    for b in blocks(page):
        where = f"{page.name}:{b['line']}"
        assert b["lang"] in LANGUAGES, f"{where}: label the block ```{'|'.join(sorted(LANGUAGES))}, not ```{b['lang']}"
        assert b["marker"] in SKIPS | {"file", None}, f"{where}: unknown marker docs-test: {b['marker']}"
        assert (b["marker"] == "file") == bool(b["arg"]), f"{where}: `docs-test: file NAME` names the file, alone"


def test_markers_only_stand_before_blocks():
    for page in pages():
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            if "docs-test:" in line:
                assert MARKER.fullmatch(line.strip()), f"{page.name}:{i + 1}: a malformed docs-test marker"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), \
                    f"{page.name}:{i + 1}: a docs-test marker must stand on the line before its block"


def test_the_readme_runs_its_cpu_blocks():
    """The README's runnable blocks: only GPU, download, install and server blocks are left out, and those are few."""
    bs = blocks(README)
    runnable = [b for b in bs if b["lang"] in {"sh", "python", "toml"} and b["marker"] not in SKIPS]
    assert {b["lang"] for b in runnable} >= {"sh", "python", "toml"}
    assert [b["marker"] for b in bs].count("install") == 2  # the two set-up commands


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KESTREL_CACHE", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               KESTREL_LOAD_PLUGINS=os.environ.get("KESTREL_LOAD_PLUGINS", ""))
    return env


def kestrel_lines(code: str) -> list[tuple[list[str], str | None]] | None:
    """A block of plain ``kestrel ARGS [> FILE]`` lines as (argv, output file), or None."""
    found = []
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        out = None
        if len(words) > 2 and words[-2] == ">":
            words, out = words[:-2], words[-1]
        if words[0] != "kestrel" or any(w in {"&&", "|", ";", ">", "<"} for w in words):
            return None
        found.append((words[1:], out))
    return found


def run_in_process(code: str, where: str) -> None:
    for argv, out in kestrel_lines(code):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = cli.main(argv)
        assert rc == 0, f"{where}: kestrel {shlex.join(argv)} exited {rc}: {stderr.getvalue()[-2000:]}"
        if out:
            Path(out).write_text(stdout.getvalue())


@pytest.mark.parametrize("page", [ROOT / p for p in RUN], ids=lambda p: p.name)
def test_the_page_runs(page, tmp_path, monkeypatch):
    here, home = tmp_path / "work", tmp_path / "home"
    here.mkdir()
    home.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KESTREL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.syspath_prepend(str(here))
    plugins.load_plugins()
    before = set(map(id, plugins.pm.get_plugins()))
    namespace: dict = {"__name__": "__docs__"}
    try:
        for b in blocks(page):
            where = f"{page.relative_to(ROOT)}:{b['line']}"
            if b["marker"] in SKIPS or b["lang"] == "text":
                continue
            if b["marker"] == "file":
                (here / b["arg"]).write_text(b["code"])
                if b["arg"].endswith(".toml"):
                    tomllib.loads(b["code"])
                elif b["arg"].endswith(".py"):
                    compile(b["code"], where, "exec")
            elif b["lang"] == "toml":
                tomllib.loads(b["code"])
            elif b["lang"] == "python":
                exec(compile(b["code"], where, "exec"), namespace)
            elif b["lang"] == "sh" and page != README and kestrel_lines(b["code"]):
                run_in_process(b["code"], where)
            elif b["lang"] == "sh":
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]], cwd=here, env=_env(home),
                                      capture_output=True, text=True, timeout=600)
                assert done.returncode == 0, (f"{where} exited {done.returncode}:\n{b['code']}\n"
                                              f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}")
    finally:
        for plugin in plugins.pm.get_plugins():
            if id(plugin) not in before:
                plugins.pm.unregister(plugin)
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(here)):
                del sys.modules[name]
