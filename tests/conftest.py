"""Shared fixtures: tiny checkpoints written once per session, the backends under test, run helpers.

KESTREL_TEST_BACKENDS (comma-separated, default "cpu_ref") picks the backends that tests taking a
``backend`` argument run on; tox sets it per environment. A test parametrized onto "cuda" is
marked ``cuda`` automatically, and every ``cuda``/``crosscheck`` test skips cleanly without a GPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from pathlib import Path

# Tiny models gain nothing from intra-op threads, and on a small or busy box OpenMP threads that
# wait for a descheduled sibling make a 0.02 ms copy take 8 ms. One thread, also for subprocesses.
THREADS = os.environ.setdefault("KESTREL_TEST_THREADS", "1")
# kestrel's built-ins only: no outcome depends on the plugin packages a user installed here.
# Subprocesses inherit it; a test of a third-party package names that package itself.
os.environ["KESTREL_LOAD_PLUGINS"] = ""
os.environ.setdefault("OMP_NUM_THREADS", THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(THREADS))

from kestrel_core import plugins  # noqa: E402
from kestrel_core.config import KestrelConfig
from kestrel_core.engine.run import load
from kestrel_core.tools.presets import preset_config, write_checkpoint

BACKENDS = [b.strip() for b in os.environ.get("KESTREL_TEST_BACKENDS", "cpu_ref").split(",") if b.strip()]
GPU_BACKENDS = {"cuda"}
HAVE_CUDA = torch.cuda.is_available()

#: Apply to a test that needs a GPU: ``@requires_cuda``. Marked ``cuda``, skips without one.
requires_cuda = pytest.mark.cuda


def skip_without_cuda() -> None:
    """Call inside a test or fixture that needs a GPU: skips cleanly where there is none."""
    if not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize(
            "backend",
            [pytest.param(b, marks=[pytest.mark.cuda] if b in GPU_BACKENDS else [], id=b) for b in BACKENDS],
        )


_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@pytest.fixture(autouse=True)
def signal_handlers_as_found(request):
    """Each test leaves SIGINT, SIGTERM and SIGHUP as it found them: one that left SIGINT ignored (the CLI's ``main()``
    ignores signals as a process exits) would make every later in-process signal test see nothing. One that changed
    them is named in a warning, and they are put back. (A run started with SIGINT ignored, as a shell's background
    job is without job control, fails those tests whatever this does: start the suite in the foreground.)"""
    held = {s: signal.getsignal(s) for s in _SIGNALS}
    yield
    moved = [signal.Signals(s).name for s, h in held.items() if signal.getsignal(s) is not h]
    for s, h in held.items():
        signal.signal(s, signal.SIG_DFL if h is None else h)
    if moved:
        warnings.warn(f"{request.node.nodeid} left the handlers of {', '.join(moved)} changed (put back)")


def pytest_runtest_setup(item):
    if (item.get_closest_marker("cuda") or item.get_closest_marker("crosscheck")) and not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")


# --- checkpoints ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny Qwen3 preset (6 layers, tied embeddings, bf16), written once."""
    return write_checkpoint(preset_config("tiny"), tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_llama_ckpt(tmp_path_factory) -> Path:
    """The tiny Llama preset (5 layers, untied lm_head, llama3 rope scaling, bf16), written once."""
    return write_checkpoint(preset_config("tiny-llama"), tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory) -> Path:
    """The demo preset (8 layers, ~13 MiB bf16) as one file."""
    return write_checkpoint(preset_config("demo"), tmp_path_factory.mktemp("ckpt") / "demo")


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def backends() -> list[str]:
    return list(BACKENDS)


# --- running ----------------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 3]


def run_config(backend: str = "cpu_ref", **flags) -> KestrelConfig:
    """A KestrelConfig from ``section__field=value`` flags; fixed-length greedy generation by default."""
    flags.setdefault("generation__max_new_tokens", 6)
    flags.setdefault("generation__stop_at_eos", False)
    return KestrelConfig().override(backend__name=backend, **flags)


def run_once(model_dir, backend: str = "cpu_ref", prompt=PROMPT, keep_logits: bool = False, **flags):
    """Generate once; returns (GenerationResult, counters after the run closed)."""
    cfg = run_config(backend, **flags)
    with load(model_dir) as model:
        with model.open(cfg) as run:
            result = run.generate(prompt_ids=list(prompt), keep_logits=keep_logits)
        final = run.counters.snapshot()
    return result, final


@pytest.fixture
def run_model():
    """``run_model(model_dir, backend=..., residency__keep=..., ...)`` -> (result, final counters)."""
    return run_once


@pytest.fixture
def register_plugin():
    """Register plugin objects for one test (pm.register), and unregister them afterwards."""
    plugins.load_plugins()
    names = []

    def register(obj, name=None):
        names.append(plugins.pm.register(obj, name=name))
        return obj

    yield register
    for name in names:
        if plugins.pm.get_plugin(name) is not None:
            plugins.pm.unregister(name=name)
