"""Errors handlers raise; transports map them to their status codes
(gRPC: INVALID_ARGUMENT with BadRequest field violations, NOT_FOUND, ALREADY_EXISTS,
FAILED_PRECONDITION, DEADLINE_EXCEEDED, CANCELLED)."""


class MnemeError(Exception):
    """Base of mneme's request errors."""


class InvalidArgument(MnemeError, ValueError):
    """A request field is invalid. ``violations`` is a list of (field path, description)."""

    def __init__(self, field: str, description: str, *more: tuple[str, str]):
        self.violations = [(field, description), *more]
        super().__init__("; ".join(f"{f}: {d}" for f, d in self.violations))


class NotFound(MnemeError):
    """The named resource (bank, memory, operation) does not exist."""


class AlreadyExists(MnemeError):
    """The resource to create exists already (a create with a client-chosen id, AIP-133:
    the retry of a call whose answer was lost finds its own first try)."""


class DeadlineExceeded(MnemeError):
    """The work was accepted but did not finish before the deadline; it goes on."""


class Cancelled(MnemeError):
    """The caller cancelled the request; its work was stopped."""


class FailedPrecondition(MnemeError):
    """The resource is not in a state that allows the call (e.g. a replay already runs,
    or the generation to delete is live); the message says what would allow it."""


class Unavailable(MnemeError):
    """The service cannot answer now (starting, or a dependency such as the broker or
    another service is unreachable); the client may retry."""


class ResourceExhausted(MnemeError):
    """A bound of the server's is reached for now (e.g. as many sync calls wait as it
    lets wait); the client may retry later, or call asynchronously."""


class RecordTooLarge(MnemeError):
    """A record is larger than the event log takes (on Kafka: the producer's
    ``max.request.size``, 1 MiB, or the topic's ``max.message.bytes``). The same record
    always is: retrying cannot help."""


class ConfigurationError(MnemeError, ValueError):
    """The settings or the deployment cannot work (a value, a file, the topics); the
    message names what to fix. Processes stop with it at start (one line, exit 1)."""
