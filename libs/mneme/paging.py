"""Opaque page tokens and page sizes for every List RPC (AIP-158).

A token is URL-safe base64 (no padding) of a small JSON array ``[kind, position]``:
``kind`` names the list it belongs to ("banks", "operations", …), so a token of one list
is refused by another, and ``position`` is where the next page starts (an id or an
offset). Tokens are checked on every call: anything this API did not issue is
INVALID_ARGUMENT naming ``page_token``, never silently page 1.
"""

from __future__ import annotations

import base64
import binascii
import json

from mneme.errors import InvalidArgument

DEFAULT_PAGE_SIZE = 100
#: The largest offset a token may carry: a signed 64-bit integer, as SQLite and the
#: other stores take it (a list is never near so long).
MAX_OFFSET = 2**63 - 1

_BAD = "not a page token this API returned for this list"


def page_size(size: int, field: str = "page_size", default: int = DEFAULT_PAGE_SIZE,
              maximum: int | None = None) -> int:
    """The effective page size: ``default`` for 0, at most ``maximum`` (default
    ``MNEME_LIMIT_PAGE_SIZE``: larger requests are coerced, AIP-158); negative →
    InvalidArgument naming ``field``."""
    if size < 0:
        raise InvalidArgument(field, "must not be negative")
    if maximum is None:
        from mneme.limits import limits
        maximum = limits().page_size
    return min(size or default, maximum)


def encode_token(kind: str, position: str | int) -> str:
    """The token of the page starting at ``position`` in list ``kind``."""
    raw = json.dumps([kind, position], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, kind: str, type_: type = str, field: str = "page_token"):
    """``position`` of a token from :func:`encode_token` for list ``kind``; None for an
    empty token (the first page). Raises InvalidArgument naming ``field`` for anything
    else (bad base64, not a JSON array of two, another list's token, a position of the
    wrong type, an offset beyond :data:`MAX_OFFSET`, an id with control characters or
    lone surrogates)."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        value = json.loads(raw.decode())
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise InvalidArgument(field, _BAD) from None
    # a list of two, as issued (an object of two keys would unpack into its keys)
    if type(value) is not list or len(value) != 2:
        raise InvalidArgument(field, _BAD)
    got_kind, position = value
    if got_kind != kind or type(position) is not type_:
        raise InvalidArgument(field, _BAD)
    # Positions this API issues: offsets a store can take, ids of printable characters.
    if type_ is int and not 0 <= position <= MAX_OFFSET:
        raise InvalidArgument(field, _BAD)
    # JSON's "\ud800" escape decodes to a lone surrogate, which no store can encode
    if type_ is str and any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 or 0xd800 <= ord(c) < 0xe000
                            for c in position):
        raise InvalidArgument(field, _BAD)
    return position
