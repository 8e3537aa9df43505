"""Generated blocks in hand-written docs: the one place that rewrites what lies between two marker lines."""
from __future__ import annotations


def replace_between(text: str, block: str, begin: str, end: str, where: str) -> str:
    """``text`` with what lies between the lines ``begin`` and ``end`` replaced by ``block``
    (the markers stay); exits naming ``where`` unless there is exactly one such block.

    >>> replace_between("a <!-- b --> old <!-- e --> z", "new", "<!-- b -->", "<!-- e -->", "x.md")
    'a <!-- b -->\\nnew\\n<!-- e --> z'
    """
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{where}: expected one block between {begin!r} and {end!r}")
    head, rest = text.split(begin)
    return f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}"
