"""Request limits: one table of bounds for every string, list and map field of the API.

:func:`check` walks any request message of ``mneme.v1`` by its descriptor and returns
every violation as ``(field path, description)``, e.g. ``("items[3].content", "at most
200000 characters")``, so transports can refuse a request (gRPC INVALID_ARGUMENT with
``BadRequest`` field violations) in milliseconds, before any model or store is touched.
One walker serves every RPC: a field is bounded by its name (:data:`_STRING_RULES`,
:data:`_REPEATED_RULES`), anything not named gets the generic bound, so a new field is
bounded the day it is added.

What is checked, per field kind:

* strings — length in characters; no NUL anywhere (no store can hold it); identifiers
  (names, ids, tags, metadata keys, page tokens) no control characters at all;
* repeated fields and maps — entry counts;
* enums — the value is one the API defines (proto3 lets unknown numbers through);
* ``google.protobuf.Timestamp`` — within 0001-01-01 … 9999-12-31, nanos in [0, 1e9);
* ``time_zone`` — an IANA name or a fixed offset (:func:`mneme.timeparse.time_zone`);
* ``google.protobuf.Struct`` (a JSON schema) — its encoded size;
* ``page_size`` / ``max_tokens`` — not negative; ``max_tokens`` at most a bound (a larger
  ``page_size`` is coerced to the largest page, AIP-158).

The bounds come from :class:`Limits` (``MNEME_LIMIT_*`` variables; README "Limits").
Violations inside one retain item are reported under ``items[i]`` so the caller can fail
that item alone (:func:`split_items`).
"""

from __future__ import annotations

import re
from functools import lru_cache

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from mneme.domain import MAX_EPOCH, MIN_EPOCH
from mneme.timeparse import time_zone


class Limits(BaseSettings):
    """Bounds of request fields (characters unless named otherwise). Environment:
    ``MNEME_LIMIT_<FIELD>``, e.g. ``MNEME_LIMIT_QUERY_CHARS=4000``."""

    model_config = SettingsConfigDict(env_prefix="MNEME_LIMIT_", extra="ignore")

    query_chars: int = Field(8_000, ge=1, description="Recall / Reflect query")
    context_chars: int = Field(20_000, ge=1, description="Retain item or Reflect context")
    content_chars: int = Field(200_000, ge=1, description="Retain item content")
    items: int = Field(1_000, ge=1, description="Items per Retain request")
    tags: int = Field(64, ge=1, description="Tags per item, per request or per scope")
    tag_chars: int = Field(200, ge=1, description="One tag")
    metadata_entries: int = Field(64, ge=1, description="Metadata entries per item")
    metadata_key_chars: int = Field(128, ge=1, description="A metadata key")
    metadata_value_chars: int = Field(8_192, ge=1, description="A metadata value")
    id_chars: int = Field(256, ge=1, description="Resource names, document / request / memory "
                                                 "ids")
    mission_chars: int = Field(20_000, ge=1, description="Bank retain / observations mission")
    text_chars: int = Field(4_096, ge=1, description="Any other string (display name, …)")
    list_entries: int = Field(256, ge=1, description="Any other repeated field (types, scopes, "
                                                     "update_mask paths)")
    schema_bytes: int = Field(65_536, ge=1, description="Reflect response_schema, encoded")
    page_size: int = Field(1_000, ge=1, description="Largest page of a List call (a larger "
                                                    "page_size is served as this, AIP-158)")
    max_tokens: int = Field(1_000_000, ge=1, description="Largest max_tokens (Recall, Reflect, mental models)")
    request_bytes: int = Field(32 << 20, ge=1, description="A whole gRPC request, encoded "
                                                           "(larger: RESOURCE_EXHAUSTED)")
    key_ids: int = Field(1_000, ge=1, description="Key ids per BatchGetDataKeys request")
    scope_assignments: int = Field(
        16_384, ge=1, description="Retain: the items times the observation scopes each goes "
        "into (EXPLICIT: every listed scope; PER_TAG: each of the item's tags): "
        "consolidation works each fact into each of its scopes (~1.5 ms each)")

    @property
    def key_id_chars(self) -> int:
        """A data key id (``d:<document_id>#<generation>``): an id plus its prefix and
        generation (:data:`KEY_ID_OVERHEAD`)."""
        return self.id_chars + KEY_ID_OVERHEAD

    @property
    def page_token_chars(self) -> int:
        """A page token: the longest one a list issues for ids, tags and scopes within
        these limits (:func:`mneme.paging.max_token_chars`), so every issued token is
        taken back."""
        from mneme import paging  # paging reads the limits lazily too
        return paging.max_token_chars(self.key_id_chars, self.tag_chars, self.tags)


#: Characters a data key id adds to the id it is made of ("d:" + "#" + 16 hex digits,
#: with room to spare).
KEY_ID_OVERHEAD = 32


@lru_cache(maxsize=1)
def limits() -> Limits:
    """The process's limits (read once from the environment)."""
    return Limits()


# A string field's bound and kind by its name: "id" strings admit no control character,
# "text" strings any but NUL.
_STRING_RULES: dict[str, tuple[str, str]] = {
    "query": ("query_chars", "text"),
    "content": ("content_chars", "text"),
    "context": ("context_chars", "text"),
    "retain_mission": ("mission_chars", "text"),
    "observations_mission": ("mission_chars", "text"),
    "reflect_mission": ("mission_chars", "text"),
    "tags": ("tag_chars", "id"),
    "scope": ("tag_chars", "id"),
    "name": ("id_chars", "id"),
    "parent": ("id_chars", "id"),
    "document_id": ("id_chars", "id"),
    "request_id": ("id_chars", "id"),
    "memory_id": ("id_chars", "id"),
    "directive_id": ("id_chars", "id"),
    "mental_model_id": ("id_chars", "id"),
    "page_token": ("page_token_chars", "id"),
    "extraction_mode": ("id_chars", "id"),
    "erasure": ("id_chars", "id"),
    "paths": ("id_chars", "id"),
    "time_zone": ("id_chars", "id"),
    "key_ids": ("key_id_chars", "id"),
}
_REPEATED_RULES: dict[str, str] = {"items": "items", "tags": "tags", "scope": "tags",
                                   "metadata": "metadata_entries", "key_ids": "key_ids"}
_INT_RULES: dict[str, str] = {"page_size": "page_size", "max_tokens": "max_tokens"}

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def timestamp_violation(ts: Message) -> str:
    """Why a ``google.protobuf.Timestamp`` is not representable, or "" when it is."""
    if not MIN_EPOCH <= ts.seconds <= int(MAX_EPOCH):
        return "must be between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z"
    if not 0 <= ts.nanos <= 999_999_999:
        return "nanos must be in [0, 999999999]"
    return ""


def _string(value: str, path: str, name: str, lim: Limits, out: list) -> None:
    attr, kind = _STRING_RULES.get(name, ("text_chars", "text"))
    bound = getattr(lim, attr)
    if len(value) > bound:
        out.append((path, f"at most {bound} characters (got {len(value)})"))
    elif kind == "id" and _CONTROL.search(value):
        out.append((path, "must not contain control characters (newline, tab, NUL, ...)"))
    elif name == "time_zone":
        try:
            time_zone(value)
        except ValueError as e:
            out.append((path, str(e)))
    elif "\x00" in value:
        out.append((path, "must not contain NUL (\\x00) characters"))


def _scalar(fd: FieldDescriptor, value, path: str, lim: Limits, out: list) -> None:
    if fd.type == FieldDescriptor.TYPE_STRING:
        _string(value, path, fd.name, lim, out)
    elif fd.type == FieldDescriptor.TYPE_ENUM:
        if value not in fd.enum_type.values_by_number:
            names = ", ".join(v.name for v in fd.enum_type.values if v.number)
            out.append((path, f"unknown value {value}; one of {names}"))
    elif fd.name in _INT_RULES:
        bound = getattr(lim, _INT_RULES[fd.name])
        if value < 0:
            out.append((path, "must not be negative"))
        elif value > bound and fd.name != "page_size":  # AIP-158: a larger page is coerced
            out.append((path, f"at most {bound}"))


def _walk(msg: Message, prefix: str, lim: Limits, out: list) -> None:
    full = msg.DESCRIPTOR.full_name
    if full == "google.protobuf.Timestamp":
        problem = timestamp_violation(msg)
        if problem:
            out.append((prefix or "timestamp", problem))
        return
    if full in ("google.protobuf.Struct", "google.protobuf.Value"):
        if msg.ByteSize() > lim.schema_bytes:
            out.append((prefix, f"at most {lim.schema_bytes} bytes encoded"))
        return
    for fd, value in msg.ListFields():
        path = f"{prefix}.{fd.name}" if prefix else fd.name
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            bound = getattr(lim, _REPEATED_RULES.get(fd.name, "list_entries"))
            if len(value) > bound:
                out.append((path, f"at most {bound} entries (got {len(value)})"))
                continue
            for k, v in value.items():
                if isinstance(k, str):
                    if len(k) > lim.metadata_key_chars or not k:
                        out.append((path, f"keys must be 1..{lim.metadata_key_chars} characters"))
                    elif _CONTROL.search(k):
                        out.append((path, "keys must not contain control characters"))
                if isinstance(v, str):
                    if len(v) > lim.metadata_value_chars:
                        out.append((f"{path}[{k!r}]"[:200],
                                    f"values are at most {lim.metadata_value_chars} characters"))
                    elif "\x00" in v:
                        out.append((f"{path}[{k!r}]"[:200], "must not contain NUL (\\x00)"))
                elif isinstance(v, Message):
                    _walk(v, f"{path}[{k!r}]", lim, out)
            continue
        if fd.is_repeated:
            bound = getattr(lim, _REPEATED_RULES.get(fd.name, "list_entries"))
            if len(value) > bound:
                out.append((path, f"at most {bound} entries (got {len(value)})"))
                continue
            for i, v in enumerate(value):
                if fd.message_type is not None:
                    _walk(v, f"{path}[{i}]", lim, out)
                else:
                    _scalar(fd, v, f"{path}[{i}]", lim, out)
        elif fd.message_type is not None:
            _walk(value, path, lim, out)
        else:
            _scalar(fd, value, path, lim, out)


def check(msg: Message, lim: Limits | None = None) -> list[tuple[str, str]]:
    """Every violation of the limits in request ``msg``, as (field path, description);
    [] when it is within bounds. Never raises for a well-formed protobuf message."""
    out: list[tuple[str, str]] = []
    _walk(msg, "", lim or limits(), out)
    return out


_ITEM = re.compile(r"^items\[(\d+)\]")
#: A map entry's key in a field path (``metadata['k']``) and whatever follows it.
_MAP_KEY = re.compile(r"\[['\"].*$", re.S)


def field_on_log(path: str) -> str:
    """``path`` (a violation's field, from :func:`check`) without the map key it names:
    ``items[1].metadata['k']`` → ``items[1].metadata``. A refused item's field goes on
    the log in the clear (``ItemFailure.field``), where a metadata key, which events
    carry only sealed, would outlive the deletion of its document."""
    return _MAP_KEY.sub("", path)


def split_items(violations: list[tuple[str, str]]) -> tuple[list[tuple[str, str]],
                                                            dict[int, list[tuple[str, str]]]]:
    """Split violations into request-level ones and those of single ``items[i]``
    (index → violations), so a retain fails a bad item alone."""
    request, items = [], {}
    for path, desc in violations:
        m = _ITEM.match(path)
        if m:
            items.setdefault(int(m.group(1)), []).append((path, desc))
        else:
            request.append((path, desc))
    return request, items


#: Request messages whose method runs :func:`check` itself (the gRPC interceptor leaves
#: them alone): its ``items[i]`` violations fail that item alone, not the whole request.
PER_ITEM = frozenset({"mneme.v1.RetainRequest"})
