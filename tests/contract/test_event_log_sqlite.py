"""The embedded event log (:class:`mneme.bus.sqlite_log.SqliteEventLog`) against the
shared EventLog contract; a "place" is one SQLite file, reopened for the crash tests."""

from __future__ import annotations

import pytest

from mneme.bus.sqlite_log import SqliteEventLog
from .event_log_suite import EventLogSuite


class TestSqliteEventLog(EventLogSuite):
    ATOMIC_COMMIT = True  # commit appends its outputs and moves offsets in one transaction

    @pytest.fixture
    def place(self, tmp_path):
        return str(tmp_path / "log.db")

    def make_log(self, place):
        return SqliteEventLog(place)

    def crash_after_outputs(self, log, monkeypatch):
        # _append_tx inserts commit's outputs inside its transaction; failing right after
        # it is the process dying between the outputs and the offset update
        real = log._append_tx

        def crash(*args, **kwargs):
            real(*args, **kwargs)
            raise RuntimeError("simulated crash")

        monkeypatch.setattr(log, "_append_tx", crash)
