"""Plugin subcommands: ``register_commands(register)`` adds a ``kestrel NAME``; a clash with a built-in is an error."""

from __future__ import annotations

import json
import types

import pytest

from kestrel_core.cli import SUBCOMMANDS, main
from kestrel_core.hookspecs import hookimpl


def _hello(calls):
    def add_arguments(p):
        p.add_argument("--who", default="world")

    def run(args):
        calls.append(args.who)
        print(f"hello {args.who}")
        return 3

    return types.SimpleNamespace(HELP="say hello", add_arguments=add_arguments, run=run)


def _commands(**named):
    class Commands:
        @hookimpl
        def register_commands(self, register):
            for name, command in named.items():
                register(name, command)

    return Commands()


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error: ") and err.count("\n") == 1, err
    return err


def test_a_plugin_command_runs_and_is_listed(register_plugin, capsys):
    calls = []
    register_plugin(_commands(hello=_hello(calls)), "hello-commands")
    assert main(["hello", "--who", "kestrel"]) == 3  # its exit code
    assert calls == ["kestrel"] and capsys.readouterr().out == "hello kestrel\n"
    assert main(["plugins", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "hello"]
    assert rows == [{"kind": "command", "name": "hello", "package": "(registered at run time)", "version": "-",
                     "plugin": "hello-commands"}]
    assert main(["plugins"]) == 0
    assert any(line.split()[:2] == ["command", "hello"] for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("name", [n.replace("_", "-") for n in SUBCOMMANDS])
def test_a_plugin_command_named_like_a_builtin_is_an_error(register_plugin, capsys, name):
    register_plugin(_commands(**{name: _hello([])}), "clashing-commands")
    err = _one_line_error(capsys, ["plugins"])
    assert f"command {name!r} from clashing-commands collides with the built-in `kestrel {name}`" in err


def test_a_command_without_run_is_an_error(register_plugin, capsys):
    register_plugin(_commands(broken=types.SimpleNamespace(HELP="no run")), "broken-commands")
    assert "lacks add_arguments, run" in _one_line_error(capsys, ["plugins"])


def test_two_plugins_registering_one_command_is_an_error(register_plugin, capsys):
    register_plugin(_commands(hello=_hello([])), "first")
    register_plugin(_commands(hello=_hello([])), "second")
    assert "command 'hello' is registered twice" in _one_line_error(capsys, ["plugins"])
