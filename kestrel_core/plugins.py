"""The module-level plugin manager and the registries that discovery hooks fill."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from typing import Any, Callable

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError

ENTRY_POINT_GROUP = "kestrel"
# Unset: load every installed plugin package. Set: only these (comma-separated distribution
# names) besides kestrel's built-ins; empty means the built-ins alone (the tests run so).
LOAD_ENV = "KESTREL_LOAD_PLUGINS"
BUILTIN_DIST = "kestrel"

pm = pluggy.PluginManager("kestrel")
pm.add_hookspecs(hookspecs)

_loaded = False

SINGULAR = {"backends": "backend", "policies": "policy", "allocators": "allocator", "gates": "gate"}


def load_plugins() -> pluggy.PluginManager:
    """Load the plugins of the entry-point group once (those ``KESTREL_LOAD_PLUGINS`` selects); a misspelt hook is an error."""
    global _loaded
    if not _loaded:
        _block_unselected(os.environ.get(LOAD_ENV))
        _loaded = True
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {exc.plugin!r} is invalid: {exc}") from None
    check_plugins()
    return pm


def _norm(dist_name: str) -> str:
    return dist_name.lower().replace("_", "-").replace(".", "-")


def _block_unselected(selection: str | None) -> None:
    """Block the entry points of plugin packages that ``KESTREL_LOAD_PLUGINS`` does not name."""
    if selection is None:
        return
    wanted = {_norm(n) for n in selection.split(",") if n.strip()} | {BUILTIN_DIST}
    offered = [(_norm(dist.metadata["Name"] or ""), ep.name) for dist in importlib.metadata.distributions()
               for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    keep = {ep for name, ep in offered if name in wanted}  # pluggy blocks by entry-point name
    for name, ep in offered:
        if ep not in keep:
            pm.set_blocked(ep)
    found = {name for name, _ in offered}
    missing = sorted(wanted - found - {BUILTIN_DIST})
    if missing:
        raise PluginError(f"{LOAD_ENV} names {', '.join(missing)}, which no installed package provides; "
                          "check the spelling against `pip list`, or unset it to load every plugin")


def check_plugins() -> None:
    """Raise if a registered plugin implements a hook that no spec declares."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"{exc} (a misspelt hook name? the specs are in kestrel_core/hookspecs.py)"
        ) from None


@attrs.frozen
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    package: str
    version: str


def _dist_of(plugin: object) -> tuple[str, str]:
    for plug, dist in pm.list_plugin_distinfo():
        if plug is plugin:
            return dist.project_name, dist.version
    return "(registered at run time)", "-"


def registry(kind: str) -> dict[str, Registration]:
    """Call one discovery hook (kind: backends, policies, allocators, gates) and return name -> Registration."""
    load_plugins()
    caller = getattr(pm.hook, f"register_{kind}")
    found: dict[str, Registration] = {}
    # Reversed: pluggy calls the last registered first; the first registration of a name wins.
    for impl in reversed(caller.get_hookimpls()):
        package, version = _dist_of(impl.plugin)

        def register(name: str, factory: Callable[..., Any], _impl=impl, _pkg=package, _ver=version) -> None:
            if name in found:
                raise PluginError(
                    f"{SINGULAR.get(kind, kind)} {name!r} is registered twice: by {found[name].plugin} and by {_impl.plugin_name}"
                )
            found[name] = Registration(kind, name, factory, _impl.plugin_name, _pkg, _ver)

        impl.function(register=register)
    return found


def lookup(kind: str, name: str) -> Registration:
    """The registration of ``name``; an unknown name is an error listing the ones available."""
    regs = registry(kind)
    if name not in regs:
        available = ", ".join(sorted(regs)) or "none (is kestrel installed? pip install -e .)"
        raise PluginError(f"unknown {SINGULAR.get(kind, kind)} {name!r}; available: {available}")
    return regs[name]


@contextlib.contextmanager
def activated(*plugins: object):
    """Register run-scoped plugin objects (the active policy and allocator) for one run."""
    names = []
    try:
        for plugin in plugins:
            names.append(pm.register(plugin))
        check_plugins()
        yield pm
    finally:
        for name in names:
            pm.unregister(name=name)


def resolved(name: str) -> Callable[..., Any]:
    """A hook caller resolved once per run: the sole implementation's function when there is one.

    The hot loop calls this instead of paying pluggy's dispatch per entry per token.
    The returned callable takes keyword arguments and keeps the hook's result shape.
    """
    caller = getattr(pm.hook, name)
    impls = caller.get_hookimpls()
    if len(impls) == 1 and not (impls[0].hookwrapper or impls[0].wrapper):
        fn = impls[0].function
        if caller.spec.opts.get("firstresult"):
            return fn

        def broadcast(**kwargs):
            result = fn(**kwargs)
            return [] if result is None else [result]

        return broadcast
    return caller
