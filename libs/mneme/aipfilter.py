"""A subset of AIP-160 filters for List RPCs: equalities joined by ``AND``.

Grammar (whitespace around tokens is free)::

    filter     := comparison ("AND" comparison)*
    comparison := FIELD "=" VALUE
    FIELD      := a name the list allows
    VALUE      := "a quoted string" (\\" and \\\\ escaped) | a bare word [A-Za-z0-9_.-]+

Anything else (OR, NOT, other operators, parentheses, unknown fields or values, a field
compared twice) is INVALID_ARGUMENT naming the request's ``filter`` field: a filter that
is not understood never lists more, or other, items than asked for.
"""

from __future__ import annotations

import re
from typing import Mapping

from mneme.errors import InvalidArgument

_TOKEN = re.compile(r'\s*(?:(?P<quoted>"(?:[^"\\]|\\.)*")|(?P<word>[A-Za-z0-9_.\-]+)'
                    r'|(?P<op>=)|(?P<other>\S))')


def _tokens(text: str, field: str) -> list[tuple[str, str]]:
    """(kind, text) of each token: quoted (unescaped), word, op; InvalidArgument naming
    ``field`` for any other character."""
    out, at = [], 0
    text = text.rstrip()
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m.group("other") is not None:  # (every non-blank character is some token)
            raise InvalidArgument(field, f"unexpected {m.group('other')!r} at character "
                                         f"{m.start('other') + 1}: the filter is "
                                         'FIELD = "VALUE" joined by AND')
        if m.group("quoted") is not None:
            out.append(("quoted", re.sub(r"\\(.)", r"\1", m.group("quoted")[1:-1])))
        elif m.group("word") is not None:
            out.append(("word", m.group("word")))
        else:
            out.append(("op", "="))
        at = m.end()
    return out


def parse_equalities(text: str, allowed: Mapping[str, tuple[str, Mapping[str, str]]],
                     field: str = "filter") -> dict[str, str]:
    """The equalities of filter ``text``, as {canonical field: canonical value}.

    ``allowed`` maps each field name a caller may write (aliases included) to (its
    canonical name, {value as written, lower-cased: canonical value}); values are
    matched case-insensitively. "" or blank → {} (no filter). Raises InvalidArgument
    naming ``field`` for anything outside the grammar of this module, an unknown field or
    value (the message lists the allowed ones), or a field given twice."""
    tokens = _tokens(text, field)
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        if i and not (tokens[i] == ("word", "AND")):
            raise InvalidArgument(field, f"expected AND before {tokens[i][1]!r} (only "
                                         "comparisons joined by AND are supported)")
        if i:
            i += 1
        part = tokens[i:i + 3]
        if (len(part) < 3 or part[0][0] != "word" or part[1] != ("op", "=")
                or part[2][0] == "op"):
            raise InvalidArgument(field, 'expected FIELD = "VALUE" (e.g. state = "FAILED"); '
                                         f"fields: {', '.join(sorted(allowed))}")
        name, value = part[0][1], part[2][1]
        if name not in allowed:
            raise InvalidArgument(field, f"unknown field {name!r}; one of "
                                         f"{', '.join(sorted(allowed))}")
        canonical, values = allowed[name]
        if value.lower() not in values:
            raise InvalidArgument(field, f"unknown {name} {value!r}; one of "
                                         f"{', '.join(sorted(values))} (any case)")
        if canonical in out:
            raise InvalidArgument(field, f"{canonical} is compared more than once")
        out[canonical] = values[value.lower()]
        i += 3
    return out
