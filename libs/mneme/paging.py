"""Opaque page tokens and page sizes for every List RPC (AIP-158).

A token is URL-safe base64 (no padding) of the UTF-8 JSON array ``[binding, position]``:

* ``binding`` — a digest of the token's *kind*: the list and every request field other
  than ``page_size`` and ``page_token`` (parent, filters), e.g. ``("memories", bank_id,
  document_id, types)``. A token is refused by another list, and by the same list called
  with other filters (AIP-158). A digest, so the token does not grow with the filters.
* ``position`` — the sort key of the last item served (keyset paging: items added or
  removed between calls shift nothing): an id, a tag, a number, or an array of those.

Tokens are checked on every call: anything this API did not issue is INVALID_ARGUMENT
naming ``page_token``, never silently page 1. Every token issued for positions within the
request limits is at most :func:`max_token_chars` long, the bound the limits check
``page_token`` against (:attr:`mneme.limits.Limits.page_token_chars`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from functools import lru_cache

from mneme.errors import InvalidArgument

DEFAULT_PAGE_SIZE = 100
#: The largest integer position a token may carry: a signed 64-bit integer, as SQLite and
#: the other stores take it.
MAX_OFFSET = 2**63 - 1

_BAD = "not a page token this API returned for this list"
#: What no identifier holds (the limits' rule for ids and tags, :mod:`mneme.limits`), and
#: lone surrogates (JSON's "\ud800" decodes to one; no store can encode it).
_NOT_IN_IDS = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
#: Bytes of the binding digest: collisions between two kinds are out of reach.
_DIGEST_BYTES = 12


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


def _binding(kind) -> str:
    """The digest of ``kind`` (a string, or a tuple/list of JSON values)."""
    raw = json.dumps(kind, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).digest()[:_DIGEST_BYTES]
    return base64.urlsafe_b64encode(digest).decode()


def encode_token(kind, position) -> str:
    """The token of the page after ``position`` (the last item served's sort key: a str,
    an int, a float or a list of those) in list ``kind`` (a str, or a tuple of the list's
    name and every filter of the request, JSON values)."""
    raw = json.dumps([_binding(kind), position], ensure_ascii=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode("utf-8", "surrogatepass")).decode().rstrip("=")


def _fits(value, shape) -> bool:
    """``value`` (decoded JSON) has ``shape``: ``str`` (an id: no control character),
    ``int`` (0..MAX_OFFSET), ``float`` (a finite float or a 64-bit integer), a tuple of shapes (an array of
    exactly those) or ``[shape]`` (an array of any length of that shape)."""
    if isinstance(shape, tuple):
        return (type(value) is list and len(value) == len(shape)
                and all(_fits(v, s) for v, s in zip(value, shape)))
    if isinstance(shape, list):
        return type(value) is list and all(_fits(v, shape[0]) for v in value)
    if shape is str:
        return type(value) is str and not _NOT_IN_IDS.search(value)
    if shape is int:
        return type(value) is int and 0 <= value <= MAX_OFFSET
    if shape is float:  # JSON writes a whole float as one; a store takes 64-bit integers
        return (type(value) is float and math.isfinite(value)
                or type(value) is int and -MAX_OFFSET <= value <= MAX_OFFSET)
    raise TypeError(f"unknown position shape {shape!r}")


def decode_token(token: str, kind, shape=str, field: str = "page_token"):
    """``position`` of a token from :func:`encode_token` for list ``kind`` (the same kind
    the token was issued for), checked to have ``shape`` (see :func:`_fits`); None for an
    empty token (the first page). Raises InvalidArgument naming ``field`` for anything
    else (bad base64, not a JSON array of two, another list's or other filters' token, a
    position of another shape, an integer beyond :data:`MAX_OFFSET`, a string with
    control characters or lone surrogates)."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        value = json.loads(raw.decode())
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, RecursionError):
        raise InvalidArgument(field, _BAD) from None
    # a list of two, as issued (an object of two keys would unpack into its keys)
    if type(value) is not list or len(value) != 2:
        raise InvalidArgument(field, _BAD)
    binding, position = value
    if binding != _binding(kind) or not _fits(position, shape):
        raise InvalidArgument(field, _BAD)
    return position


#: A character that costs the most in a token: 4 bytes of UTF-8 (an escaped '"' or '\\'
#: costs 2; control characters, escaped longer, are in no id).
_WORST_CHAR = "\U0010ffff"


@lru_cache(maxsize=8)
def max_token_chars(id_chars: int, tag_chars: int, tags: int) -> int:
    """The length of the longest token this API issues when ids (document ids, key ids,
    …) are at most ``id_chars`` characters and an observation scope at most ``tags``
    tags of at most ``tag_chars``: the token of the largest position a list holds (an
    id, a tag, a scope, an operation's (time, id)), each character the costliest."""
    longest = [_WORST_CHAR * max(id_chars, tag_chars),
               [_WORST_CHAR * tag_chars] * tags,
               [-1.7976931348623157e+308, _WORST_CHAR * id_chars]]
    return max(len(encode_token("", p)) for p in longest)
