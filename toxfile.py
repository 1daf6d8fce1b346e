"""tox plugin (loaded by tox from this file): every test environment reuses the torch that tox runs beside.

tox's ``sitepackages = true`` exposes the *base* interpreter's site-packages, not those of the
virtualenv tox was installed into, so inside a venv each tox environment resolved a torch of its
own (a multi-GB CUDA build). Instead, before anything is installed into a run environment, this
plugin links the torch distribution of the interpreter running tox, with everything it requires,
into one folder of that environment and names the folder in a ``.pth`` file. pip then finds torch
installed and leaves it alone, and nothing else of the host's site-packages is visible: a
user's other kestrel plugins stay out of the tests.
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sys
from pathlib import Path

from packaging.requirements import Requirement
from tox.plugin import impl
from tox.tox_env.python.api import Python
from tox.tox_env.runner import RunToxEnv

SHARED = "torch"
PTH = "kestrel-host-torch.pth"
_linked: set[str] = set()


def closure(name: str) -> list[md.Distribution]:
    """``name``'s installed distribution and those it requires (markers evaluated, no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        want = todo.pop()
        try:
            dist = md.distribution(want)
        except md.PackageNotFoundError:
            continue  # an optional or marker-excluded requirement that is not installed
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def top_level(dist: md.Distribution) -> set[Path]:
    """The top-level files and folders a distribution installed into site-packages."""
    out = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first not in ("..", "__pycache__"):
            out.add(Path(dist.locate_file(first)))
    return out


@impl
def tox_on_install(tox_env, arguments, section, of_type):
    # Before the first install of each run environment (deps, the package's requirements or the package).
    if not isinstance(tox_env, RunToxEnv) or not isinstance(tox_env, Python) or tox_env.name in _linked:
        return
    _linked.add(tox_env.name)
    try:
        md.distribution(SHARED)
    except md.PackageNotFoundError:
        raise SystemExit(f"tox: install {SHARED} beside tox first (pip install torch==2.13.0), so the envs can share it")
    env_python = tox_env.base_python.version_info
    if tuple(env_python[:2]) != sys.version_info[:2]:
        raise SystemExit(f"tox: the envs run Python {env_python[0]}.{env_python[1]} but {SHARED} is installed for "
                         f"{sys.version_info[0]}.{sys.version_info[1]}; run tox with the interpreter the envs use")
    overlay = Path(tox_env.env_dir) / "host-torch"
    shutil.rmtree(overlay, ignore_errors=True)
    overlay.mkdir(parents=True)
    for dist in closure(SHARED):
        for path in top_level(dist):
            (overlay / path.name).symlink_to(path, target_is_directory=path.is_dir())
    (Path(tox_env.env_site_package_dir()) / PTH).write_text(f"{overlay}\n")
