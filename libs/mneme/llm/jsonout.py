"""Reading JSON from model output: lenient parsing with small repairs, schema validation.

Repairs are the ones that cannot change meaning: a Markdown code fence around the
object, prose before or after it, trailing commas, and closing brackets a model forgot at
the very end of an otherwise complete reply. Output cut off by the token limit is *not*
repaired here (closing it would silently drop whatever was cut); callers re-ask instead.
"""

from __future__ import annotations

import json
import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")


class JsonOutputError(ValueError):
    """The reply is not usable JSON; ``reason`` is ``malformed`` or ``schema``. The
    message never quotes the reply (it ends up in item failures, in the clear on the
    log); ``hint`` may, for re-asking the model."""

    def __init__(self, reason: str, detail: str, hint: str | None = None):
        super().__init__(detail)
        self.reason = reason
        self.hint = hint if hint is not None else detail


def clean_text(text: str) -> str:
    """``text`` with each lone UTF-16 surrogate (U+D800–U+DFFF) replaced by U+FFFD and
    each surrogate pair joined into its character; the same object when it has none.

    A model that cuts an emoji's escape in half (``"\\ud83d"``) yields a Python string
    no UTF-8 encoder, protobuf field or store accepts: cleaned where model text enters
    mneme, it cannot fail a whole request further on."""
    if not _LONE_SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def clean_value(value: object) -> object:
    """:func:`clean_text` applied to every string in a decoded JSON ``value`` (object
    keys too); other values unchanged."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_value(v) for v in value]
    return value


def _close_brackets(s: str) -> str:
    """Append the closers of brackets (and a string) left open at the end of ``s``."""
    stack: list[str] = []
    in_str = esc = False
    for ch in s:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return s + ('"' if in_str else "") + "".join(reversed(stack))


def parse_json(text: str) -> object:
    """The JSON value in a model reply. Tries the text as is, then the inside of a code
    fence, then from the first ``{``/``[`` to the last ``}``/``]``, each also with trailing
    commas removed and open brackets closed; its strings are :func:`clean_value`'d.
    Raises JsonOutputError("malformed")."""
    if text is None or not text.strip():
        raise JsonOutputError("malformed", "empty reply")
    candidates = [text.strip()]
    m = _FENCE.search(text)
    if m:
        candidates.append(m.group(1).strip())
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if starts:
        start = min(starts)
        end = max(text.rfind("}"), text.rfind("]"))
        candidates.append(text[start:end + 1] if end > start else text[start:])
    last_err = ""
    for c in candidates:
        for variant in (c, _TRAILING_COMMA.sub(r"\1", c)):
            for v in (variant, _close_brackets(variant)):
                try:
                    return clean_value(json.loads(v))
                except ValueError as e:
                    last_err = str(e)
    raise JsonOutputError("malformed", f"not valid JSON ({last_err})")


def validate(value: object, schema: dict | None) -> None:
    """Check ``value`` against the JSON ``schema`` (Draft 2020-12). Raises
    JsonOutputError("schema") naming the first violation's path."""
    if not schema:
        return
    import jsonschema  # a litellm dependency; only imported on the LLM path

    validator = jsonschema.Draft202012Validator(schema)
    err = next(iter(sorted(validator.iter_errors(value), key=lambda e: list(e.path))), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        # jsonschema's message quotes the failing value (user content, or facts derived
        # from it): only the model is told it
        raise JsonOutputError("schema", f"{where}: breaks the schema's {err.validator!r} "
                                        f"rule", hint=f"{where}: {err.message[:300]}")
