"""kestrel: run language models whose weights do not fit in device memory.

    from kestrel_core import load
    model = load("/path/to/model")          # config.json + *.safetensors
    with model.open(policy="asymmetric", keep=2, backend="cpu_ref") as run:
        res = run.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
    print(res.token_ids, res.text, res.ms_per_token, res.counters)
"""

import os

# OpenMP's threads, which torch computes on, spin while they wait for work by default: on a machine whose cores are
# busy, two spinning threads made every command 4-19x slower than one thread. Passive waiting (a thread sleeps) cost
# 11% on an idle 2-core machine and saved 2.3-4x on a busy one (docs/backends.md). Set here, before any kestrel module
# imports torch (a process that imported torch first keeps its own); an OMP_WAIT_POLICY already set stays.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["Model", "load"]


def __getattr__(name: str):
    """``load`` and ``Model``, imported on first use: ``import kestrel_core.cli`` stays light (no torch), so the
    command's own Ctrl-C handling is in place before the heavy imports run."""
    if name in __all__:
        from kestrel_core.engine import run

        return getattr(run, name)
    raise AttributeError(f"module 'kestrel_core' has no attribute {name!r}")
