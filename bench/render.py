"""Render the docs' tables from the records: every block between ``<!-- bench:NAME -->`` and ``<!-- /bench -->`` in
README.md and docs/*.md is rewritten by ``bench.tables.BLOCKS[NAME]`` from bench/results/.

    python -m bench render            # rewrite the blocks
    python -m bench render --check    # say which blocks differ from their records (exit 1), change nothing
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.records import Records
from bench.stamp import REPO, RESULTS
from bench.tables import BLOCKS

# a block's body never runs into another block's marker, so an empty or unclosed block cannot swallow the page
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>(?:(?!<!-- /?bench)[\s\S])*?)(<!-- /bench -->)")


def pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render_text(text: str, recs: Records, where: str = "") -> str:
    """``text`` with each block rewritten from the records (an unknown block name is an error)."""
    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in BLOCKS:
            raise KeyError(f"{where}: no table called {name!r} (known: {', '.join(BLOCKS)})")
        return m.group(1) + BLOCKS[name](recs).strip() + "\n" + m.group(4)

    return BLOCK.sub(one, text)


def rendered(root: Path = REPO, results: Path = RESULTS) -> dict[Path, tuple[str, str]]:
    """For each page with a block: (its text now, its text rendered from the records)."""
    recs = Records.load(results)
    out = {}
    for page in pages(root):
        text = page.read_text()
        if BLOCK.search(text):
            out[page] = (text, render_text(text, recs, page.name))
    return out


def blocks_of(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def add_arguments(p) -> None:
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 where a block differs from its records")


def main(args) -> int:
    stale = []
    for page, (now, new) in rendered().items():
        if now == new:
            continue
        old_blocks, new_blocks = blocks_of(now), blocks_of(new)
        stale += [f"{page.relative_to(REPO)}: {name}" for name in new_blocks if old_blocks.get(name) != new_blocks[name]]
        if not args.check:
            page.write_text(new)
    if args.check:
        for s in stale:
            print(f"differs from its records: {s}", file=sys.stderr)
        return 1 if stale else 0
    print("\n".join(f"rendered {s}" for s in stale) or "every block already matches its records")
    return 0
