"""The event log adapters by URL (``MNEME_BUS_URL``): what the composition root opens.

Kept apart from :mod:`mneme.bus` (topic names, partitioning) so that importing those
pulls in no adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from mneme.errors import ConfigurationError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from mneme.ports import EventLog


def open_event_log(url: str, **kafka_options) -> "EventLog":
    """Open the event log named by ``url`` (``MNEME_BUS_URL``).

    * ``sqlite:///abs/path/events.db`` → :class:`~mneme.bus.sqlite_log.SqliteEventLog`
      on that file (created with its parent directories if missing).
    * ``kafka://host:port[,host:port][?option=value]`` →
      :class:`~mneme.bus.kafka_log.KafkaEventLog` (connects, retrying for
      ``connect_timeout_s``); ``kafka_options`` (fields of
      :class:`~mneme.bus.kafka_log.KafkaOptions`, None = default) override the query.
      The sqlite log ignores them.

    Raises ValueError for an unknown scheme (naming it) or a malformed URL;
    ConnectionError when no Kafka broker answers.
    """
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "sqlite":
        path = unquote(parsed.path)
        if parsed.netloc or not path or path == "/":
            raise ConfigurationError(f"MNEME_BUS_URL: a sqlite event log URL needs an absolute "
                                     f"path, as in sqlite:///var/lib/mneme/events.db; got {url!r}")
        if path.startswith("//"):  # SQLAlchemy-style sqlite:////abs/path
            path = path[1:]
        from mneme.bus.sqlite_log import SqliteEventLog  # lazy: SQLite only when used

        return SqliteEventLog(path)
    if scheme == "kafka":
        from mneme.bus.kafka_log import open_kafka  # lazy: aiokafka only when used

        return open_kafka(url, **kafka_options)
    raise ConfigurationError(f"MNEME_BUS_URL: unknown event log URL scheme {scheme!r} in "
                             f"{url!r} (supported: sqlite, kafka)")


__all__ = ["open_event_log"]
