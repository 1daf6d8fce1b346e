"""The module-level plugin manager and the registries that discovery hooks fill."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any, Callable, Iterable

import attrs
import pluggy

from kestrel_core import hookspecs
from kestrel_core.errors import PluginError

ENTRY_POINT_GROUP = "kestrel"
# Unset: load every installed plugin package. Set: only these (comma-separated distribution
# names) besides kestrel's built-ins; empty means the built-ins alone (the tests run so).
LOAD_ENV = "KESTREL_LOAD_PLUGINS"
BUILTIN_DIST = "kestrel"

pm = pluggy.PluginManager("kestrel")
pm.add_hookspecs(hookspecs)

_loaded = False

SINGULAR = {"backends": "backend", "policies": "policy", "allocators": "allocator", "gates": "gate", "commands": "command",
            "expert_policies": "expert policy", "drafters": "drafter"}


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


def check_plugins(manager: pluggy.PluginManager = pm) -> None:
    """Raise if a registered plugin implements a hook that no spec declares."""
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc} (a misspelt hook name? the specs are in kestrel_core/hookspecs.py)") from None


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
    """Call one discovery hook (kind: backends, policies, allocators, gates, commands) and return name -> Registration."""
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


def implementations(hook: str, manager: pluggy.PluginManager = pm) -> list[Callable[..., Any]]:
    """The plain functions of every plugin registered for ``hook`` now, in registration order.

    A run resolves its observers once, when it opens, and calls them directly at each boundary: no pluggy
    dispatch per boundary. (Wrapper implementations are not supported for these hooks.)
    """
    impls = getattr(manager.hook, hook).get_hookimpls()
    wrapped = [impl.plugin_name for impl in impls if impl.hookwrapper or impl.wrapper]
    if wrapped:
        raise PluginError(f"plugin {wrapped[0]!r} wraps {hook}; observers of {hook} must be plain implementations")
    return [impl.function for impl in reversed(impls)]  # pluggy lists the last registered first


def observers(extra: Iterable[object] = ()) -> dict[str, tuple]:
    """Every observer of a run, hook by hook (``plan.Observers``' fields): the plugins registered in the manager now,
    then ``extra``, objects whose hook methods observe this run alone. ``extra`` is checked as a plugin is (a misspelt hook is an error) in a manager of its
    own, so the global one never holds a run's objects."""
    load_plugins()
    own = pluggy.PluginManager("kestrel")
    own.add_hookspecs(hookspecs)
    for obj in extra:
        own.register(obj)
    check_plugins(own)
    return {hook: tuple(implementations(hook) + implementations(hook, own)) for hook in OBSERVED}


OBSERVED = ("on_layer_advance", "on_experts_routed", "preload", "alloc", "release")  # the hooks a run's observers hear
