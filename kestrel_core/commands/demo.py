"""kestrel demo: the embedded default model, swept on every available backend."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kestrel_core.io import progress
from kestrel_core.config import KestrelConfig, load_config
from kestrel_core.engine.run import Model
from kestrel_core.errors import ConfigError
from kestrel_core.formats.modelconfig import read_json
from kestrel_core.tools.presets import preset_config, write_checkpoint
from kestrel_core.tools.sweep import available_backends, run_sweep
from kestrel_core.commands.sweep import check_plot, report

HELP = "write the embedded demo checkpoint if missing, sweep it on every available backend, print the verdict"
KEEPS = [1, 2, 3, 4, 7, 8, "off"]
POLICIES = ["asymmetric", "future_evicting", "pinned_set", "belady"]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def default_cache() -> Path:
    root = os.environ.get("KESTREL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kestrel")
    return Path(root) / "demo-qwen3"


def cache_path(given: str | None) -> Path:
    """Where the demo checkpoint lives: ``--cache-dir``, else $KESTREL_CACHE's (a root that is a file is named as such,
    not met with "File exists")."""
    path = Path(given) / "demo-qwen3" if given else default_cache()
    root = path.parent
    if root.exists() and not root.is_dir():
        where = "--cache-dir" if given else ("KESTREL_CACHE" if os.environ.get("KESTREL_CACHE") else "the cache root")
        raise ConfigError(f"{where} {root} is a file, not a directory; name a directory (it is made where missing)")
    return path


def add_arguments(p):
    p.add_argument("--cache-dir", help="where the demo checkpoint lives (default: $KESTREL_CACHE or ~/.cache/kestrel)")
    p.add_argument("--config", help="kestrel.toml for generation settings")
    p.add_argument("--max-new-tokens", type=int, default=12, help="tokens each run generates (default 12)")
    p.add_argument("--threads", type=int, help="cpu_ref's torch threads (default: the cores this process may use)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", help="write the cost curve to this new .png file (checked before the sweep; never replaces a file)")


def ensure_demo_model(path: Path) -> Path:
    """The demo checkpoint at ``path``: reused when it is kestrel's demo, written whole when ``path`` is new or empty."""
    cfg = preset_config("demo")
    config_json = path / "config.json"
    if config_json.is_file():
        try:
            same = read_json(config_json) == json.loads(json.dumps(cfg.to_hf_dict()))
        except ConfigError:  # unreadable, too large, or not JSON: not the demo's
            same = False
        if not same:
            raise ConfigError(f"{path} holds a model that is not kestrel's demo checkpoint; "
                              "pass another --cache-dir, or remove that directory")
        return path
    progress.say(f"demo: writing the demo checkpoint to {path}")
    return write_checkpoint(cfg, path, seed=0, flag="--cache-dir", force_flag=None)  # demo has no --force


def run(args) -> int:
    check_plot(args.plot)
    base: KestrelConfig = load_config(args.config).override(  # checked before the cache is written
        generation__max_new_tokens=args.max_new_tokens, generation__stop_at_eos=False, backend__threads=args.threads
    )
    with progress.shown(not args.json):
        path = ensure_demo_model(cache_path(args.cache_dir))
        backends = available_backends(None)
        progress.say(f"demo: model {path}, backends: {', '.join(backends)}")
        with Model(path) as model:
            rows = run_sweep(model, base, PROMPT, KEEPS, POLICIES, ["pool", "free"], backends)
    return report(rows, args.json, args.plot, {"model": str(path), "prompt_ids": PROMPT})
