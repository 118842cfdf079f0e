"""Resource names (Google API design guide): ``banks/{bank_id}``,
``banks/{bank_id}/memories/{memory_id}``, ``banks/{bank_id}/observations/{id}``,
``banks/{bank_id}/opinions/{id}``, ``banks/{bank_id}/entities/{entity_id}``,
``banks/{bank_id}/directives/{directive_id}``,
``banks/{bank_id}/documents/{document_id}``, ``operations/{operation_id}``."""

from __future__ import annotations

import re
import uuid

from mneme.domain import BANK_ID_RE
from mneme.errors import InvalidArgument


def bank_id_of(name: str, field: str = "parent") -> str:
    """``banks/{bank_id}`` → bank_id. Raises InvalidArgument naming ``field``."""
    if not name:
        raise InvalidArgument(field, "required, e.g. 'banks/my-bank'")
    parts = name.split("/")
    if len(parts) != 2 or parts[0] != "banks":
        raise InvalidArgument(field, f"must be 'banks/{{bank_id}}', got {name!r}")
    check_bank_id(parts[1], field)
    return parts[1]


def check_bank_id(bank_id: str, field: str = "bank_id") -> str:
    """Validate a bank slug: lowercase letters, digits, '-' and '_', 1..63 chars."""
    if not BANK_ID_RE.fullmatch(bank_id or ""):
        raise InvalidArgument(field, "bank id must match [a-z0-9][a-z0-9_-]{0,62}")
    return bank_id


def _bank_child(name: str, collection: str, what: str, field: str) -> tuple[str, str]:
    """``banks/{bank_id}/{collection}/{uuid}`` → (bank_id, uuid); InvalidArgument naming
    ``field`` for anything else."""
    parts = (name or "").split("/")
    if len(parts) != 4 or parts[0] != "banks" or parts[2] != collection or not parts[3]:
        raise InvalidArgument(field, f"must be 'banks/{{bank_id}}/{collection}/{{{what}_id}}'")
    check_bank_id(parts[1], field)
    return parts[1], check_uuid(parts[3], field, f"{what} id")


def memory_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/memories/{memory_id}`` → (bank_id, memory_id)."""
    return _bank_child(name, "memories", "memory", field)


#: The collection of each kind of memory unit that has one of its own (AIP-122: one name
#: per resource); facts (world, experience) are ``memories``.
UNIT_COLLECTIONS = {"observation": "observations", "opinion": "opinions"}


def unit_of(name: str, field: str = "name") -> tuple[str, str, str | None]:
    """The name of a memory unit as the API returns it → (bank_id, unit_id, fact_type
    its collection holds: "observation", "opinion", or None for ``memories``, which
    answers for a unit of any type, as names issued before observations and opinions had
    their own collections did). InvalidArgument naming ``field`` for any other name."""
    parts = (name or "").split("/")
    kinds = {c: t for t, c in UNIT_COLLECTIONS.items()}
    if len(parts) == 4 and parts[0] == "banks" and parts[2] in kinds:
        bank_id, unit_id = _bank_child(name, parts[2], kinds[parts[2]], field)
        return bank_id, unit_id, kinds[parts[2]]
    try:
        return (*memory_of(name, field), None)
    except InvalidArgument:
        raise InvalidArgument(field, "must be 'banks/{bank_id}/memories/{memory_id}' (or "
                              "'.../observations/{observation_id}', "
                              "'.../opinions/{opinion_id}')") from None


def unit_name(bank_id: str, unit_id: str, fact_type: str) -> str:
    """The name of a memory unit: in its own collection when its type has one
    (:data:`UNIT_COLLECTIONS`), else ``banks/{bank_id}/memories/{unit_id}``."""
    return f"banks/{bank_id}/{UNIT_COLLECTIONS.get(fact_type, 'memories')}/{unit_id}"


def check_uuid(value: str, field: str, what: str = "id") -> str:
    """Validate a canonical UUID (lowercase, hyphenated: what mneme issues); returns it.
    Raises InvalidArgument naming ``field``."""
    try:
        ok = str(uuid.UUID(value)) == value
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgument(field, f"{what} must be a UUID such as "
                              "'0b6e9c52-5d1f-4f0e-9a43-6d6e656d6500'")
    return value


def observation_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/observations/{observation_id}`` → (bank_id, observation_id)."""
    return _bank_child(name, "observations", "observation", field)


def opinion_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/opinions/{opinion_id}`` → (bank_id, opinion_id)."""
    return _bank_child(name, "opinions", "opinion", field)


def entity_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/entities/{entity_id}`` → (bank_id, entity_id)."""
    return _bank_child(name, "entities", "entity", field)


def directive_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/directives/{directive_id}`` → (bank_id, directive_id)."""
    return _bank_child(name, "directives", "directive", field)


def mental_model_of(name: str, field: str = "name") -> tuple[str, str]:
    """``banks/{bank_id}/mental-models/{mental_model_id}`` → (bank_id, mental_model_id)."""
    return _bank_child(name, "mental-models", "mental_model", field)


def operation_of(name: str, field: str = "name") -> str:
    """``operations/{operation_id}`` (or a bare id) → operation_id (a UUID). Raises
    InvalidArgument naming ``field``; a name of another collection or with more segments
    is refused as such, not as a malformed id."""
    op = name.split("/", 1)[1] if name.startswith("operations/") else name
    if not op:
        raise InvalidArgument(field, "required, e.g. 'operations/{id}'")
    if "/" in op:
        raise InvalidArgument(field, "must be 'operations/{operation_id}'")
    return check_uuid(op, field, "operation id")


def bank_name(bank_id: str) -> str:
    return f"banks/{bank_id}"


def memory_name(bank_id: str, memory_id: str) -> str:
    return f"banks/{bank_id}/memories/{memory_id}"


def directive_name(bank_id: str, directive_id: str) -> str:
    return f"banks/{bank_id}/directives/{directive_id}"


def mental_model_name(bank_id: str, model_id: str) -> str:
    return f"banks/{bank_id}/mental-models/{model_id}"


def entity_name(bank_id: str, entity_id: str) -> str:
    return f"banks/{bank_id}/entities/{entity_id}"


def document_name(bank_id: str, document_id: str) -> str:
    """``banks/{bank_id}/documents/{document_id}`` (output only: a document id may hold
    '/', so requests name a document by ``parent`` and ``document_id``)."""
    return f"banks/{bank_id}/documents/{document_id}"


_GENERATION = re.compile(r"[1-9][0-9]{0,8}")


def generation_of(name: str, field: str = "name") -> int:
    """``generations/{n}`` → n (>= 1). Raises InvalidArgument naming ``field``."""
    parts = (name or "").split("/")
    # ASCII digits without leading zeros: str.isdigit() also takes "²" (int() refuses it)
    # and "３" or "٣" (int() reads them), which would name one generation several ways
    if len(parts) != 2 or parts[0] != "generations" or not _GENERATION.fullmatch(parts[1]):
        raise InvalidArgument(field, f"must be 'generations/{{n}}' with n >= 1, got {name!r}")
    return int(parts[1])


def check_address(address: str) -> str:
    """``address`` unchanged when it is a usable ``host:port`` gRPC address: a host (an
    IPv6 one in brackets) and a port 0..65535. A gRPC target with a scheme
    (``dns:///h:p``, ``unix:/path``) is left to gRPC. Raises ValueError naming the
    problem: gRPC itself would take port 99999 as 34463 (modulo 65536)."""
    if "://" in address or address.startswith(("unix:", "unix-abstract:", "vsock:")):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT with a port 0..65535")
    return address
