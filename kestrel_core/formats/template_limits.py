"""Bounds on rendering a chat template, which comes with a downloaded model and is code: its time, its output and the
strings it builds.

jinja2's sandbox stops a template from reaching Python, not from running forever or from building a string
of gigabytes (a 300 MB prompt got kestrel OOM-killed). Here:

- time: a line tracer on the template's own frames (jinja compiles a template to Python code named
  ``<template>``) stops the render at ``SECONDS``, however its loops nest;
- output: the render is streamed and stopped past ``CHARS`` characters;
- a single step that would build a huge value at once is refused before it runs: ``*``, ``+``, ``%`` and
  ``**`` on sequences and numbers, the filters that take a width or a count (center, indent, join, replace,
  format, tojson, lipsum), and the string methods that do (center, ljust, rjust, zfill, expandtabs, replace,
  join, format).
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Callable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHARS = 16 * 2**20  # the rendered conversation, and any string built on the way: far more than a context holds
SECONDS = 10.0
_DIGITS = re.compile(r"\d+")


class TemplateLimit(jinja2.TemplateError):
    """The template passed one of these bounds."""


def _size(n: int, what: str) -> None:
    if n > CHARS:
        raise TemplateLimit(f"{what} would be {n:,} characters, over the {CHARS:,} a prompt may have")


def _spec(fmt: Any) -> None:
    """A format string whose width or precision alone builds a huge string ('%999999999s', '{:>999999999}')."""
    if isinstance(fmt, str) and any(len(d) > 7 and int(d) > CHARS for d in _DIGITS.findall(fmt)):
        raise TemplateLimit("a format width or precision is over the size a prompt may have")


def _is_seq(v: Any) -> bool:
    return isinstance(v, (str, list, tuple))


def _padded(s: str, width=0, *args, **kwargs) -> None:
    if isinstance(width, int):
        _size(len(s) + width, "a padded string")


def _indented(s: Any, width: Any = 4, *args, **kwargs) -> None:
    s = str(s)
    _size(len(s) + (s.count("\n") + 1) * (width if isinstance(width, int) else len(str(width))), "an indented string")


def _replaced(s: Any, old: Any = "", new: Any = "", *args, **kwargs) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        _size(len(s) + (s.count(old) if old else len(s) + 1) * len(new), "a replaced string")


def _tabs(s: str, tabsize=8, *args, **kwargs) -> None:
    if isinstance(tabsize, int):
        _size(len(s) + s.count("\t") * tabsize, "a string with its tabs expanded")


def _joined(items: list | str, sep: Any) -> None:
    parts = len(items) if isinstance(items, str) else sum(len(str(x)) for x in items)
    _size(parts + len(str(sep)) * max(len(items) - 1, 0), "a joined string")


# str methods a template may call (the sandbox allows them) that take a width or a count
_STR_METHODS: dict[str, Callable] = {"center": _padded, "ljust": _padded, "rjust": _padded,
                                     "zfill": _padded, "expandtabs": _tabs, "replace": _replaced}


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the operators, filters and methods that can build a huge value in one step checked
    first. Add filters with ``set_filter``, which keeps a built-in's check."""

    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def __init__(self, **options):
        super().__init__(**options)
        self.filters["center"] = _checked(self.filters["center"], _padded)
        self.filters["indent"] = _checked(self.filters["indent"], _indented)
        self.filters["replace"] = _checked(self.filters["replace"], _replaced)
        self.filters["format"] = _checked(self.filters["format"], lambda value, *a, **k: _spec(value))
        self.filters["join"] = _join_filter(self.filters["join"])
        self.globals["lipsum"] = _checked(self.globals["lipsum"], lambda n=5, *a, **k: _size(int(n) * 1000, "lipsum"))

    def set_filter(self, name: str, func: Callable, check: Callable | None = None) -> None:
        self.filters[name] = _checked(func, check) if check else func

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _is_seq(seq) and isinstance(n, int):
                    _size(len(seq) * n, "a repeated string or list")
        elif operator == "+" and _is_seq(left) and _is_seq(right):
            _size(len(left) + len(right), "a joined string or list")
        elif operator == "%":
            _spec(left)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
            raise TemplateLimit(f"{left} ** {right} is too large a number")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any):  # str.format and format_map, sandboxed where they are looked up
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def checked(*args, **kwargs):
            _spec(value.__self__)
            return wrapped(*args, **kwargs)

        return checked

    def format_string(self, s, args, kwargs, format_func=None):  # jinja before 3.1.3 sandboxes str.format here
        _spec(s)
        return super().format_string(s, args, kwargs, format_func)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", None)
        if isinstance(owner, str):
            if name in _STR_METHODS:
                _STR_METHODS[name](owner, *args, **kwargs)
            elif name == "join" and args:
                args = (args[0] if isinstance(args[0], str) else list(args[0]), *args[1:])  # an iterator: measured, then joined
                _joined(args[0], owner)
        return super().call(__context, __obj, *args, **kwargs)


def _checked(real: Callable, check: Callable) -> Callable:
    """``real`` that first calls ``check`` with its arguments (without the context jinja passes to some filters)."""
    skip = 1 if hasattr(real, "jinja_pass_arg") else 0

    def filtered(*args, **kwargs):
        check(*args[skip:], **kwargs)
        return real(*args, **kwargs)

    if skip:
        filtered.jinja_pass_arg = real.jinja_pass_arg
    return filtered


def _join_filter(real: Callable) -> Callable:
    skip = 1 if hasattr(real, "jinja_pass_arg") else 0

    def join(*args, **kwargs):
        head, (value, *rest) = args[:skip], args[skip:]
        items = value if isinstance(value, str) else list(value)  # an iterator, measured then joined as a list
        _joined(items, rest[0] if rest else kwargs.get("d", ""))
        return real(*head, items, *rest, **kwargs)

    if skip:
        join.jinja_pass_arg = real.jinja_pass_arg
    return join


def render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """``template`` rendered with ``context``, within ``SECONDS`` and ``CHARS`` (else TemplateLimit)."""
    deadline = time.monotonic() + SECONDS

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimit(f"rendering ran past {SECONDS:g} s (a loop that does not end, or one far too long)")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None  # only the template's own code is traced

    traced = sys.gettrace() is None  # a debugger or coverage keeps its tracer; the other bounds still hold
    if traced:
        sys.settrace(call)
    try:
        out, size = [], 0
        for piece in template.generate(context):  # a dict, not keywords: no variable can clash with generate's own
            size += len(piece)
            _size(size, "the rendered conversation")
            out.append(piece)
        return "".join(out)
    finally:
        if traced:
            sys.settrace(None)
