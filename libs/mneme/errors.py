"""Errors handlers raise; transports map them to their status codes
(gRPC: INVALID_ARGUMENT with BadRequest field violations, NOT_FOUND, ALREADY_EXISTS,
FAILED_PRECONDITION, DEADLINE_EXCEEDED, CANCELLED; each with an ErrorInfo of the
class's ``reason``)."""


from typing import Iterable


class MnemeError(Exception):
    """Base of mneme's request errors. ``reason``: the UPPER_SNAKE_CASE cause a transport
    reports beside the status (gRPC: ``google.rpc.ErrorInfo.reason``, AIP-193), constant
    per class."""

    reason = "ERROR"


class InvalidArgument(MnemeError, ValueError):
    """A request field is invalid. ``violations`` is a list of (field path, description)."""

    reason = "FIELD_INVALID"

    def __init__(self, field: str, description: str, *more: tuple[str, str]):
        self.violations = [(field, description), *more]
        super().__init__("; ".join(f"{f}: {d}" for f, d in self.violations))


class NotFound(MnemeError):
    """The named resource (bank, memory, operation) does not exist."""

    reason = "RESOURCE_NOT_FOUND"


class AlreadyExists(MnemeError):
    """The resource to create exists already (a create with a client-chosen id, AIP-133:
    the retry of a call whose answer was lost finds its own first try)."""

    reason = "RESOURCE_ALREADY_EXISTS"


class DeadlineExceeded(MnemeError):
    """The work was accepted but did not finish before the deadline; it goes on."""

    reason = "DEADLINE_EXCEEDED"


class Cancelled(MnemeError):
    """The caller cancelled the request; its work was stopped."""

    reason = "CANCELLED_BY_CALLER"


class FailedPrecondition(MnemeError):
    """The resource is not in a state that allows the call (e.g. a replay already runs,
    or the generation to delete is live); the message says what would allow it."""

    reason = "RESOURCE_STATE_PRECONDITION"


class Unavailable(MnemeError):
    """The service cannot answer now (starting, or a dependency such as the broker or
    another service is unreachable); the client may retry."""

    reason = "SERVICE_UNAVAILABLE"


class ResourceExhausted(MnemeError):
    """A bound of the server's is reached for now (e.g. as many sync calls wait as it
    lets wait); the client may retry later, or call asynchronously."""

    reason = "SERVER_LIMIT_REACHED"


class RecordTooLarge(MnemeError):
    """A record is larger than the event log takes (on Kafka: the producer's
    ``max.request.size``, 1 MiB, or the topic's ``max.message.bytes``). The same record
    always is: retrying cannot help."""

    reason = "RECORD_TOO_LARGE"


class ConfigurationError(MnemeError, ValueError):
    """The settings or the deployment cannot work (a value, a file, the topics); the
    message names what to fix. Processes stop with it at start (one line, exit 1)."""

    reason = "CONFIGURATION_ERROR"


class RemoteError(Exception):
    """Base of errors that report another server's failure in its words (a model
    provider's answer, see ``mneme.llm.types.LlmError``). :func:`resource_shortage` never
    reads a shortage into such words, nor into an error that quotes them: they may say
    "no space left on device" of the provider's own disk, or echo the user's prompt."""


#: SQLite's result codes for a full disk and for a file it could not open
#: (``sqlite3.SQLITE_FULL``, ``sqlite3.SQLITE_CANTOPEN``).
_SQLITE_FULL, _SQLITE_CANTOPEN = 13, 14


def _out_of_files() -> bool:
    """Whether this process cannot open a file now for want of descriptors (EMFILE,
    ENFILE): SQLite answers "unable to open database file" at the limit, errno unsaid."""
    import errno
    import os
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        return e.errno in (errno.EMFILE, errno.ENFILE)
    return False

#: Messages by which libraries that hide the errno report a shortage: SQLite's
#: SQLITE_FULL text, and Rust's ``std::io::Error`` as Tantivy and Qdrant Edge relay it.
_SHORTAGE_TEXT = (("database or disk is full", "disk space"),
                  ("no space left on device", "disk space"),
                  ("os error 28", "disk space"),
                  ("disk quota exceeded", "disk space"),
                  ("os error 122", "disk space"),
                  ("too many open files", "open files"),
                  ("os error 24", "open files"),
                  ("os error 23", "open files"),
                  ("not enough space available", "disk space"))


def _chain(exc: BaseException, sources: bool = False) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``, else ``__context__``
    unless suppressed by ``raise ... from None``, as a traceback prints them;
    with ``sources``, else a ``source`` exception, as qdrant_client's
    ResponseHandlingException holds httpx's), outermost first, each once, up to the first
    :class:`MnemeError`: what that was raised from was answered as that error already."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and not isinstance(e, MnemeError):
        seen.add(id(e))
        chain.append(e)
        source = getattr(e, "source", None) if sources else None
        # a context raised ``from None`` is not what ``e`` comes from (nor printed)
        context = None if e.__suppress_context__ else e.__context__
        e = e.__cause__ or context or (source if isinstance(source, BaseException) else None)
    return chain


def resource_shortage(exc: BaseException) -> str | None:
    """What the machine ran short of when ``exc`` (or an exception it was raised from)
    is such a failure: "disk space" (ENOSPC, EDQUOT, SQLITE_FULL) or "open files"
    (EMFILE, ENFILE); None for any other error. Such a failure is the server's, not
    the request's or the event's: the same work succeeds once room is made, so it is
    RESOURCE_EXHAUSTED to a caller and retried (never dead-lettered) by a consumer.

    Messages are read only below the last report of another server in the chain
    (:class:`RemoteError`, or an HTTP error: one with an int ``status_code``): that
    report and the errors wrapping it quote the other server, whose shortage this process
    cannot end, or a prompt it echoed (retried for that, a record would be for ever)."""
    import errno
    chain = _chain(exc)
    remote = [i for i, e in enumerate(chain) if isinstance(e, RemoteError)
              or isinstance(getattr(e, "status_code", None), int)]
    words_from = remote[-1] + 1 if remote else 0
    for i, e in enumerate(chain):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk space"
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return "open files"
        code = getattr(e, "sqlite_errorcode", None)  # (no sqlite3 here: a pure module)
        if code == _SQLITE_FULL:
            return "disk space"
        if code == _SQLITE_CANTOPEN and _out_of_files():  # (SQLite hides the errno)
            return "open files"
        if i < words_from:
            continue
        text = str(e).lower()
        for needle, what in _SHORTAGE_TEXT:
            if needle in text:
                return what
    return None


#: Store clients' errors that mean "the store server did not answer" (refused, reset,
#: timed out, restarting), as (top-level module, class name) so this module imports no
#: client library: redis-py (FalkorDB), the Neo4j driver, opensearch-py, and httpx
#: (Qdrant's client; qdrant's ResponseHandlingException carries it as ``source``).
_UNREACHABLE = frozenset({
    ("redis", "ConnectionError"), ("redis", "TimeoutError"),
    ("neo4j", "ServiceUnavailable"), ("neo4j", "SessionExpired"),
    ("opensearchpy", "ConnectionError"),
    ("httpx", "TransportError"),
})



def _rpc_unavailable(e: BaseException) -> str | None:
    """``"<type>: UNAVAILABLE: <details>"`` when ``e`` is a gRPC client's error
    (``grpc.RpcError``: Qdrant's client with ``prefer_grpc``, a call to another mneme
    server) whose status is UNAVAILABLE (the server is away or restarting); None
    otherwise: any other status is the request's answer, not an outage."""
    if not any((k.__module__.split(".")[0], k.__name__) == ("grpc", "RpcError")
               for k in type(e).__mro__):
        return None
    try:
        code, details = e.code(), e.details()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an RpcError that is no call: no status to read
        return None
    if getattr(code, "name", None) != "UNAVAILABLE":
        return None
    return f"{type(e).__name__}: UNAVAILABLE: {details}"


#: Clients of model providers: their connection errors are the provider's, which the
#: model gateway reports in its own words (a model error fails the item, not the store).
_MODEL_CLIENTS = ("litellm", "openai", "mneme.llm")


def store_unavailable(exc: BaseException) -> str | None:
    """The failure when ``exc`` (or an exception it was raised from) says a store server
    did not answer — refused, reset or timed out a connection (the builtin
    ``ConnectionError`` and ``TimeoutError`` raised by a socket, or a store client's own:
    see :data:`_UNREACHABLE`; or a gRPC client's status UNAVAILABLE) — as ``"ConnectionError: <message>"``; None for any other
    error. Like :func:`resource_shortage`, such a failure is the server's, not the
    event's: the same work succeeds once the store answers again, so a consumer handles
    the record again later instead of dead-lettering it, and a caller gets UNAVAILABLE.
    A model provider's connection error is not a store's: the chain is read only down
    to the first error of a model client or another server's report."""
    for e in _chain(exc, sources=True):
        if isinstance(e, RemoteError) or type(e).__module__.startswith(_MODEL_CLIENTS):
            return None  # it and what it was raised from are the model's
        unreachable = isinstance(e, (ConnectionError, TimeoutError)) or any(
            (k.__module__.split(".")[0], k.__name__) in _UNREACHABLE
            for k in type(e).__mro__)
        if unreachable:
            return f"{type(e).__name__}: {e}"
        rpc = _rpc_unavailable(e)
        if rpc is not None:
            return rpc
    return None


def held_back(exc: BaseException) -> str | None:
    """Why ``exc`` is the server's failure rather than its event's, so a consumer handles
    the record again later instead of dead-lettering it: "disk space" or "open files"
    (:func:`resource_shortage`), or "a store that answers (ConnectionError: …)"
    (:func:`store_unavailable`); None for any other error."""
    short = resource_shortage(exc)
    if short is not None:
        return short
    down = store_unavailable(exc)
    return None if down is None else f"a store that answers ({down})"


#: A run of this many characters of a user's text found in an error message makes the
#: message count as quoting it (:func:`quotes`).
QUOTE_RUN = 12
#: A user's text of at least this many characters found whole in an error message makes
#: the message count as quoting it, however short the text (a name, a metadata value);
#: shorter ones would be taken for the common words of errors ("type", "name", "date").
QUOTE_WHOLE = 5


def quotes(text: str, sent: Iterable[str]) -> bool:
    """Whether ``text`` (an error message) quotes one of the texts ``sent`` (user content:
    a model request's, an event's), as they are or JSON-escaped as on the wire: one of at
    least :data:`QUOTE_WHOLE` characters whole (``KeyError: 'Ann Smith'``), or a run of
    at least ``QUOTE_RUN + 3`` characters of one (runs of :data:`QUOTE_RUN` characters are
    looked for at every 4th position). Providers often echo the input they reject
    ("invalid content: ..."), and Python's errors quote the values they choke on: such
    words would carry a memory's text into logs, an item's failure or a dead letter in the
    clear on the event log and the operation's error, where no deletion reaches them."""
    import json
    import re
    texts = [t for t in sent if t]
    # as they are, JSON-escaped, and with json's default \uXXXX escapes too
    hay = list(dict.fromkeys([*texts, *(json.dumps(t, ensure_ascii=False)[1:-1] for t in texts),
                              *(json.dumps(t)[1:-1] for t in texts)]))
    # a text shorter than the runs below is found only whole, not inside a longer word
    # ("ping" is no quote of the request in "mapping")
    if any(len(t) >= QUOTE_WHOLE and t in text
           and re.search(rf"(?<!\w){re.escape(t)}(?!\w)", text) for t in hay):
        return True
    if not hay or len(text) < QUOTE_RUN:
        return False
    joined = "\x00".join(hay)
    return any(text[i:i + QUOTE_RUN] in joined
               for i in range(0, len(text) - QUOTE_RUN + 1, 4))
