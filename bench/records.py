"""Reading the records under bench/results/: every JSON record by name, which were written by ``python -m bench``
(``format`` 2) and which by the older scripts, and the newest of a scenario that fits.

    recs = Records.load()
    name, rec = recs.newest("stream", lambda r: r["result"]["preset"] == "qwen3-8b")
    rec = recs["decode_graphs_qwen3-8b_20261203T132426Z.json"]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from bench.stamp import RESULTS

NEW = re.compile(r"^(?P<scenario>[a-z0-9-]+)_(?P<when>\d{8}T\d{6}Z)\.json$")


def is_new(rec: dict) -> bool:
    return rec.get("format") == 2


class Records:
    def __init__(self, by_name: dict[str, dict], texts: dict[str, str], root: Path = RESULTS):
        self.by_name, self.texts, self.root = by_name, texts, root

    @classmethod
    def load(cls, root: Path = RESULTS) -> "Records":
        by_name, texts = {}, {}
        for p in sorted(Path(root).iterdir()):
            if p.name.startswith("."):
                continue
            if p.suffix == ".json":
                by_name[p.name] = json.loads(p.read_text())
            elif p.suffix == ".txt":
                texts[p.name] = p.read_text()
        return cls(by_name, texts, root)

    def __getitem__(self, name: str) -> dict:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def new(self, scenario: str, where: Callable[[dict], bool] = lambda r: True) -> list[tuple[str, dict]]:
        """The complete new-format records of ``scenario`` that ``where`` accepts, oldest first."""
        found = []
        for name, rec in self.by_name.items():
            m = NEW.match(name)
            if m and is_new(rec) and rec.get("scenario") == scenario and rec.get("complete") and where(rec):
                found.append((m["when"], name, rec))
        return [(name, rec) for _, name, rec in sorted(found)]

    def newest(self, scenario: str, where: Callable[[dict], bool] = lambda r: True) -> tuple[str, dict] | None:
        found = self.new(scenario, where)
        return found[-1] if found else None
