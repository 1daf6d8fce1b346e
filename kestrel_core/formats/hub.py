"""Model names from the local Hugging Face cache: ``Qwen/Qwen3-8B`` resolves to its cached snapshot, offline.

A model is a directory first: whatever exists at the path given is used as it is. Only a path that does not
exist and reads as a repo id (``name`` or ``org/name``) is looked up, by huggingface_hub with
``local_files_only=True``: nothing is ever downloaded, and no network call is made.
"""

from __future__ import annotations

import os
from pathlib import Path

from kestrel_core.errors import ConfigError


# What kestrel reads of a snapshot: one that lacks a file of these its download listed is incomplete, while
# files it does not read (*.bin, original/, ...) may be left out of a download.
NEEDED = ["config.json", "*.safetensors", "*.safetensors.index.json"]


class NotCachedError(ConfigError):
    """A model name that is not a directory and has no usable snapshot in the Hugging Face cache."""


def resolve(model: str | os.PathLike) -> Path:
    """The model directory for ``model``: the path itself when anything exists there or it is not a repo id
    (so the reader names what is wrong with it), else the cached snapshot of that repo's ``main``."""
    path = Path(model)
    if os.path.lexists(path) or not is_repo_id(str(model)):
        return path
    return cached_snapshot(str(model))


def is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses, by its own rule (``huggingface_hub.constants.HF_HUB_CACHE``):
    HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub. Read from the environment at each call: huggingface_hub reads it once, at
    import, which would miss a variable set later in the process."""
    env = os.environ
    home = _expand(env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                                                   "huggingface")))
    return Path(_expand(env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))))


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def cached_snapshot(repo_id: str) -> Path:
    """The directory of ``repo_id``'s cached ``main`` snapshot; it must hold config.json and *.safetensors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    cache = cache_dir()
    fetch = f"download it once with `hf download {repo_id}` (kestrel never downloads)"
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=NEEDED))
    except LocalEntryNotFoundError:
        entry = cache / ("models--" + repo_id.replace("/", "--"))  # huggingface_hub's folder of a model repo
        if entry.is_dir():
            raise NotCachedError(f"the Hugging Face cache {cache} holds {entry.name} but no complete snapshot of its "
                                 f"main revision (an interrupted download?); finish it with `hf download {repo_id}`") from None
        raise NotCachedError(f"model {repo_id!r} is not a directory and not in the Hugging Face cache (searched {cache}, "
                             f"which HF_HUB_CACHE or HF_HOME set); pass a model directory, or {fetch}") from None
    missing = [what for what, there in (("config.json", (folder / "config.json").is_file()),
                                        ("*.safetensors", any(p.is_file() for p in folder.glob("*.safetensors"))))
               if not there]
    if missing:
        raise NotCachedError(f"the cached snapshot of {repo_id} ({folder}) has no {' and no '.join(missing)}; "
                             f"kestrel reads config.json and safetensors weights: {fetch}")
    return folder
