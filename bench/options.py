"""Comma-separated options, parsed by argparse before a scenario does any work: a bad value is one line then, not a
traceback after rows have run."""

from __future__ import annotations

import argparse


def numbers(kind: type, lowest: float | None = None, none_ok: bool = False):
    """An argparse type: comma-separated ``kind`` values, each at least ``lowest`` where given (``none_ok``: an empty
    value is an empty list)."""

    def parse(text: str) -> list:
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            try:
                value = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not a {kind.__name__}; give comma-separated "
                                                 f"{kind.__name__}s, e.g. 1,4,16") from None
            if lowest is not None and value < lowest:
                raise argparse.ArgumentTypeError(f"{part} is below {lowest}")
            out.append(value)
        if not out and not none_ok:
            raise argparse.ArgumentTypeError("no values; give comma-separated ones, e.g. 1,4,16")
        return out

    return parse


def names(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated subset of ``allowed``, at least one."""

    def parse(text: str) -> set[str]:
        got = {p.strip() for p in text.split(",") if p.strip()}
        unknown = sorted(got - set(allowed))
        if unknown or not got:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: give one or more of "
                                             f"{', '.join(allowed)}, comma-separated")
        return got

    return parse


def _keep(part: str, flag: str) -> str:
    if part == "off" or (part.isdigit() and int(part) >= 1):
        return str(int(part)) if part != "off" else part
    raise argparse.ArgumentTypeError(f"{part!r} is not a keep; {flag} takes a layer count (1 or more) or off")


def keep(text: str) -> str:
    """An argparse type: one keep, a layer count or ``off`` (the text, checked: a scenario reads it as given)."""
    return _keep(text.strip(), "--keep")


def keeps(flag: str = "--keeps"):
    """An argparse type: comma-separated keeps, each a layer count or ``off``, at least one (the text, checked)."""

    def parse(text: str) -> str:
        got = [_keep(p.strip(), flag) for p in text.split(",") if p.strip()]
        if not got:
            raise argparse.ArgumentTypeError(f"no keeps; {flag} takes comma-separated layer counts or off, e.g. 1,2,off")
        return ",".join(got)

    return parse
