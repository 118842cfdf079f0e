"""Authentication and authorisation of the gRPC APIs, and their audit trail.

``MNEME_AUTH_MODE`` picks how callers are identified:

* ``open`` (default): no check; every call may do anything (``mneme up`` on loopback says
  so when it starts);
* ``api_key``: every call but health and reflection carries a key, as
  ``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata;
* ``mtls``: the server asks for a client certificate signed by ``MNEME_TLS_CLIENT_CA``
  (server certificate ``MNEME_TLS_CERT``/``MNEME_TLS_KEY``); its subject common name is
  looked up as a key entry's ``subject``.

Keys live in ``MNEME_API_KEYS_FILE`` (default ``$MNEME_DATA_DIR/api_keys.json``), hashed:
only ``sha256:<hex>`` of each key is stored (keys are 256-bit random strings, so a
plain hash is enough; the key is shown once, by ``mneme keys create``). The file is
re-read when it changes, so new keys work without a restart::

    {"keys": [{"id": "k3f9a1c2e", "hash": "sha256:…", "banks": ["alice"] | ["*"],
               "scope": "read" | "write" | "history" | "write,history",
               "created": "2026-…", "subject": "CN (mTLS)"}]}

Each RPC is a ``read``, a ``write`` or a ``history`` access of the bank its request names
(:data:`RULES`). A key's scope is one of :data:`SCOPES` or a comma-separated set of them;
every key may read, ``write`` adds the writes, ``history`` adds the data keys of the
bank's history (KeyService.BatchGetDataKeys: whoever holds them can decrypt every sealed
record of the bank on the topics and in their backups, so neither a read nor a write key
gets them; a consumer of the history gets a key of its own, ``--scope history``). No key
or an unknown key → UNAUTHENTICATED; a key without the bank, or without the scope the RPC
needs → PERMISSION_DENIED; either way the servicer is not called, so nothing is written
and no key is served. Listing every bank (ListBanks, ListOperations without
a parent) needs a ``*`` key. GetOperation, CancelOperation and RetryOperation check the
operation's bank in the servicer (:func:`require`); to a key that does not cover every bank,
another bank's operation and an unknown one are refused alike (no bank named).

Audit: :class:`AuthInterceptor` calls ``audit(AuditRecorded)`` (appended to
``mneme.audit.v1``) for every DeleteBank (in every mode), and when authentication is on,
for every write and every history-key request made with a key and every refused call.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import grpc

from mneme import telemetry
from mneme.errors import InvalidArgument
from mneme.grpc_util import abort_with, wrap_handler
from mneme.names import BANK_ID_RE, bank_id_of, unit_of

log = logging.getLogger(__name__)

MODES = ("open", "api_key", "mtls")
READ, WRITE, HISTORY = "read", "write", "history"
#: The scopes a key may hold (``read`` is implied by the others).
SCOPES = (READ, WRITE, HISTORY)
ALL_BANKS = "*"

#: RPC → (access, how to find its bank: a request field holding ``banks/{id}`` (or a
#: memory unit's name, :func:`mneme.names.unit_of`), ALL_BANKS when the call spans banks, None when the servicer checks).
RULES: dict[str, tuple[str, str | None]] = {
    "/mneme.v1.BankService/UpsertBank": (WRITE, "bank.name"),
    "/mneme.v1.BankService/GetBank": (READ, "name"),
    "/mneme.v1.BankService/ListBanks": (READ, ALL_BANKS),
    "/mneme.v1.BankService/DeleteBank": (WRITE, "name"),
    "/mneme.v1.BankService/CheckLlm": (READ, "name"),
    "/mneme.v1.BankService/GetBankStats": (READ, "name"),
    "/mneme.v1.BankService/GetBankProfile": (READ, "name"),
    "/mneme.v1.MemoryService/Retain": (WRITE, "parent"),
    "/mneme.v1.MemoryService/DeleteDocument": (WRITE, "parent"),
    "/mneme.v1.MemoryService/DeleteMemory": (WRITE, "memory:name"),
    "/mneme.v1.OperationService/GetOperation": (READ, None),
    "/mneme.v1.OperationService/ListOperations": (READ, "parent?"),
    "/mneme.v1.OperationService/CancelOperation": (WRITE, None),
    "/mneme.v1.OperationService/RetryOperation": (WRITE, None),
    "/mneme.v1.RecallService/Recall": (READ, "parent"),
    "/mneme.v1.RecallService/GetMemory": (READ, "memory:name"),
    "/mneme.v1.RecallService/ListMemories": (READ, "parent"),
    "/mneme.v1.MemoryService/Consolidate": (WRITE, "parent"),
    "/mneme.v1.MemoryService/ClearObservations": (WRITE, "parent"),
    "/mneme.v1.ObservationService/ListObservationScopes": (READ, "parent"),
    "/mneme.v1.ObservationService/ListObservations": (READ, "parent"),
    "/mneme.v1.ObservationService/GetObservation": (READ, "child:name"),
    "/mneme.v1.MemoryService/DeleteOpinion": (WRITE, "child:name"),
    "/mneme.v1.OpinionService/ListOpinions": (READ, "parent"),
    "/mneme.v1.OpinionService/GetOpinion": (READ, "child:name"),
    "/mneme.v1.DirectiveService/CreateDirective": (WRITE, "parent"),
    "/mneme.v1.DirectiveService/GetDirective": (READ, "child:name"),
    "/mneme.v1.DirectiveService/ListDirectives": (READ, "parent"),
    "/mneme.v1.DirectiveService/UpdateDirective": (WRITE, "child:directive.name"),
    "/mneme.v1.DirectiveService/DeleteDirective": (WRITE, "child:name"),
    "/mneme.v1.MentalModelService/CreateMentalModel": (WRITE, "parent"),
    "/mneme.v1.MentalModelService/GetMentalModel": (READ, "child:name"),
    "/mneme.v1.MentalModelService/ListMentalModels": (READ, "parent"),
    "/mneme.v1.MentalModelService/UpdateMentalModel": (WRITE, "child:mental_model.name"),
    "/mneme.v1.MentalModelService/DeleteMentalModel": (WRITE, "child:name"),
    "/mneme.v1.MentalModelService/ClearMentalModel": (WRITE, "child:name"),
    "/mneme.v1.MentalModelService/ListMentalModelRevisions": (READ, "child:parent"),
    "/mneme.v1.MentalModelService/RefreshMentalModel": (WRITE, "child:name"),
    "/mneme.v1.EntityService/ListEntities": (READ, "parent"),
    "/mneme.v1.EntityService/GetEntity": (READ, "child:name"),
    "/mneme.v1.EntityService/MergeEntities": (WRITE, "parent"),
    "/mneme.v1.EntityService/SplitEntity": (WRITE, "child:name"),
    "/mneme.v1.DocumentService/ListDocuments": (READ, "parent"),
    "/mneme.v1.DocumentService/GetDocument": (READ, "parent"),
    "/mneme.v1.DocumentService/ListTags": (READ, "parent"),
    "/mneme.v1.ReflectService/Reflect": (READ, "parent"),
    "/mneme.v1.ReflectService/StreamReflect": (READ, "parent"),
    # Generations span every bank's projections: a * key (write to replay or drop).
    "/mneme.v1.GenerationService/CreateGeneration": (WRITE, ALL_BANKS),
    "/mneme.v1.GenerationService/GetGeneration": (READ, ALL_BANKS),
    "/mneme.v1.GenerationService/ListGenerations": (READ, ALL_BANKS),
    "/mneme.v1.GenerationService/DeleteGeneration": (WRITE, ALL_BANKS),
    # The keys of sealed content on the log: a key with the history scope.
    "/mneme.v1.KeyService/BatchGetDataKeys": (HISTORY, "parent"),
}
#: Services that stay open in every mode.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
AUDITED_ALWAYS = {"/mneme.v1.BankService/DeleteBank"}


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def parse_scope(scope: str) -> str:
    """The normalised form of a key's scope: one of :data:`SCOPES` or a comma-separated
    set of them, e.g. ``"history, write"`` → ``"write,history"`` (``read`` dropped when
    another scope implies it). Raises ValueError for an empty or unknown scope."""
    parts = {p.strip() for p in (scope or "").split(",") if p.strip()}
    unknown = sorted(parts - set(SCOPES))
    if not parts or unknown:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)} or a comma-separated "
                         f"set of them, got {scope!r}")
    if len(parts) > 1:
        parts.discard(READ)
    return ",".join(s for s in SCOPES if s in parts)


def _scopes(scope) -> set[str]:
    """The scopes of a stored entry's ``scope`` (unknown words grant nothing)."""
    return {p.strip() for p in str(scope or "").split(",")} & set(SCOPES)


def new_key() -> tuple[str, str]:
    """A fresh (key id, key). The key embeds its id: ``mneme_<id>_<secret>``."""
    key_id = "k" + secrets.token_hex(4)
    return key_id, f"mneme_{key_id}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class Principal:
    """Who calls: ``name`` (``key:<id>``, ``cert:<CN>`` or ``anonymous``), the banks it may
    use (None: every bank), whether it may write and whether it may get the data keys of
    the history (:data:`HISTORY`)."""

    name: str
    banks: frozenset[str] | None
    write: bool
    history: bool = False

    def allows(self, bank_id: str, access: str) -> bool:
        """True when this principal may ``access`` (READ, WRITE, HISTORY) ``bank_id``
        (ALL_BANKS: every bank)."""
        if access == WRITE and not self.write:
            return False
        if access == HISTORY and not self.history:
            return False
        if self.banks is None:
            return True
        return bank_id != ALL_BANKS and bank_id in self.banks


ANONYMOUS = Principal("anonymous", None, True, history=True)
_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal",
                                                                     default=ANONYMOUS)


class PermissionDenied(Exception):
    pass


def current() -> Principal:
    """The principal of the gRPC call this thread serves (ANONYMOUS outside one)."""
    return _current.get()


def require(bank_id: str, access: str = READ) -> None:
    """Raise :class:`PermissionDenied` unless the current caller may ``access`` the bank
    (for servicers that learn the bank late, e.g. GetOperation)."""
    if not current().allows(bank_id, access):
        raise PermissionDenied(refusal(access, f"bank {bank_id!r}"))


def refusal(access: str, what: str) -> str:
    """The message of a PERMISSION_DENIED for ``access`` to ``what`` ("bank 'x'")."""
    if access == HISTORY:
        return (f"this key may not get the history keys of {what}: it needs the "
                f"'{HISTORY}' scope for it (mneme keys create --scope {HISTORY})")
    return f"this key may not {access} {what}"


# ---- the keys file ------------------------------------------------------------------------


def default_keys_file(settings) -> Path:
    f = getattr(settings, "api_keys_file", None)
    return Path(f) if f else settings.data_dir.resolve() / "api_keys.json"


class KeyStore:
    """The hashed keys of ``path``, re-read when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._by_hash: dict[str, dict] = {}
        self._by_subject: dict[str, dict] = {}

    def _load(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp == self._stamp and (stamp is not None or not self._by_hash):
                return
            entries = self.entries() if stamp is not None else []
            self._by_hash = {e["hash"]: e for e in entries if e.get("hash")}
            self._by_subject = {e["subject"]: e for e in entries if e.get("subject")}
            self._stamp = stamp

    def entries(self) -> list[dict]:
        try:
            data = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return []
        return list(data.get("keys", []))

    def add(self, banks: list[str], scope: str, subject: str = "") -> tuple[str, str]:
        """Store a new key's hash; returns (key id, key): the key is not kept. ``scope``:
        see :func:`parse_scope` (ValueError for an unknown one, no bank, or a bank id that
        is not a bank slug)."""
        scope = parse_scope(scope)
        if not banks:
            raise ValueError("name at least one bank (or '*')")
        for bank in banks:
            if bank != "*" and not BANK_ID_RE.fullmatch(bank):
                raise ValueError(f"bank {bank!r}: bank id must match {BANK_ID_RE.pattern} "
                                 "(or '*' for every bank)")
        key_id, key = new_key()
        entry = {"id": key_id, "hash": hash_key(key), "banks": sorted(set(banks)),
                 "scope": scope, "created": datetime.now(timezone.utc).isoformat()}
        if subject:
            entry["subject"] = subject
        self._write(self.entries() + [entry])
        return key_id, key

    def revoke(self, key_id: str) -> bool:
        entries = self.entries()
        kept = [e for e in entries if e.get("id") != key_id]
        if len(kept) != len(entries):
            self._write(kept)
        return len(kept) != len(entries)

    def _write(self, entries: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": entries}, f, indent=1)
        os.replace(tmp, self.path)

    @staticmethod
    def _principal(prefix: str, e: dict) -> Principal:
        banks = e.get("banks") or []
        scopes = _scopes(e.get("scope"))
        return Principal(f"{prefix}:{e.get('id') or e.get('subject')}",
                         None if ALL_BANKS in banks else frozenset(banks),
                         WRITE in scopes, HISTORY in scopes)

    def by_key(self, key: str) -> Principal | None:
        self._load()
        h = hash_key(key)
        with self._lock:
            for stored, e in self._by_hash.items():
                if hmac.compare_digest(stored, h):
                    return self._principal("key", e)
        return None

    def by_subject(self, subject: str) -> Principal | None:
        self._load()
        with self._lock:
            e = self._by_subject.get(subject)
        return self._principal("cert", e) if e else None


# ---- the interceptor ------------------------------------------------------------------------


def _key_of(md: dict) -> str | None:
    auth = md.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return md.get("x-api-key") or None


def _field(request, path: str) -> str:
    obj = request
    for part in path.split("."):
        obj = getattr(obj, part, "")
    return obj if isinstance(obj, str) else ""


def bank_of(request, how: str) -> str | None:
    """The bank a request names by rule ``how`` (see :data:`RULES`); None when the name
    is malformed (the servicer then answers INVALID_ARGUMENT and writes nothing)."""
    if how == ALL_BANKS:
        return ALL_BANKS
    try:
        if how.startswith("memory:"):  # any name of a memory unit the servicer takes
            return unit_of(_field(request, how[7:]))[0]
        if how.startswith("child:"):  # banks/{id}/<collection>/{child id}
            parts = _field(request, how[6:]).split("/")
            return bank_id_of("/".join(parts[:2])) if len(parts) == 4 and parts[3] else None
        if how.endswith("?"):
            value = _field(request, how[:-1])
            return bank_id_of(value) if value else ALL_BANKS
        return bank_id_of(_field(request, how))
    except InvalidArgument:
        return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call against ``mode`` (see the module docstring). ``audit`` (settable
    later, when the event log is open) receives AuditRecorded messages."""

    def __init__(self, mode: str = "open", keys: KeyStore | None = None,
                 audit: Callable | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"MNEME_AUTH_MODE must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "open" and keys is None:
            raise ValueError(f"MNEME_AUTH_MODE={mode} needs a keys file")
        self.mode, self.keys, self.audit = mode, keys, audit

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        md = dict(details.invocation_metadata or ())
        rule = RULES.get(method, (WRITE, ALL_BANKS))  # unknown mneme RPCs need a * write key
        return self._guard(handler, method, rule, md)

    def _guard(self, handler, method: str, rule, md: dict):
        """Wrap a unary-unary or unary-stream handler: the check first (it aborts on
        refusal), the principal as :func:`current` during the call, then the audit."""

        def before(request, context):
            checked = self._check(method, rule, md, request, context)
            return checked, _current.set(checked[0])

        def after(checked, token, context, code):
            _current.reset(token)
            if code == "OK":
                code = _code(context, "OK")
            self.after(method, checked, context, code)

        def wrap(inner, streaming: bool):
            def unary(request, context):
                checked, token = before(request, context)
                code = "OK"
                try:
                    return inner(request, context)
                except PermissionDenied as e:
                    code = "PERMISSION_DENIED"
                    abort_with(context, grpc.StatusCode.PERMISSION_DENIED, str(e),
                               "PERMISSION_DENIED")
                except BaseException:
                    code = _code(context, "UNKNOWN")
                    raise
                finally:
                    after(checked, token, context, code)

            def stream(request, context):
                checked, token = before(request, context)
                code = "OK"
                try:
                    yield from inner(request, context)
                except PermissionDenied as e:
                    code = "PERMISSION_DENIED"
                    abort_with(context, grpc.StatusCode.PERMISSION_DENIED, str(e),
                               "PERMISSION_DENIED")
                except BaseException:
                    code = _code(context, "UNKNOWN")
                    raise
                finally:
                    after(checked, token, context, code)

            return stream if streaming else unary

        return wrap_handler(handler, wrap)

    def _identify(self, md: dict, context) -> Principal | None:
        if self.mode == "open":
            return ANONYMOUS
        if self.mode == "api_key":
            key = _key_of(md)
            return self.keys.by_key(key) if key else None
        cns = (context.auth_context() or {}).get("x509_common_name") or []
        for cn in cns:
            p = self.keys.by_subject(cn.decode() if isinstance(cn, bytes) else cn)
            if p is not None:
                return p
        return None

    def _check(self, method: str, rule, md: dict, request, context):
        """Returns (principal, bank, access) or aborts the call."""
        access, how = rule
        bank = bank_of(request, how) if how else ""
        principal = self._identify(md, context)
        if principal is None:
            self._refuse(context, method, bank, access, grpc.StatusCode.UNAUTHENTICATED,
                         "unauthenticated", "a valid API key is required (authorization: "
                         "Bearer <key> or x-api-key)")
        if bank is not None and how and not principal.allows(bank, access):
            what = "every bank" if bank == ALL_BANKS else f"bank {bank!r}"
            self._refuse(context, method, bank, access, grpc.StatusCode.PERMISSION_DENIED,
                         "permission_denied", refusal(access, what), principal)
        telemetry.count_auth("allowed")
        return principal, bank or "", access

    def _refuse(self, context, method, bank, access, code, outcome, message, principal=None):
        telemetry.count_auth(outcome)
        self.record(method, bank or "", principal.name if principal else "unknown", access,
                    outcome, code.name, context)
        # ErrorInfo (AIP-193): reason UNAUTHENTICATED or PERMISSION_DENIED, and the bank
        # the call was checked against
        abort_with(context, code, message, outcome.upper(),
                   {"bank": bank} if bank else None)

    def record(self, method, bank, principal, access, outcome, status, context) -> None:
        if self.audit is None:
            return
        from mneme.events.v1 import events_pb2 as ev
        try:
            self.audit(ev.AuditRecorded(method=method, bank_id=bank if bank != ALL_BANKS else "",
                                        principal=principal, access=access, outcome=outcome,
                                        status=status, peer=context.peer() or ""))
        except Exception:  # the audit trail must not fail the call
            log.exception("audit: cannot record %s on %s", method, bank)

    def after(self, method, checked, context, code: str) -> None:
        principal, bank, access = checked
        if method in AUDITED_ALWAYS or (self.mode != "open" and access in (WRITE, HISTORY)):
            self.record(method, bank, principal.name, access, "allowed", code, context)


def _code(context, default: str) -> str:
    try:
        c = context.code()
    except Exception:
        c = None
    return getattr(c, "name", default) if c is not None else default
