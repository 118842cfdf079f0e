"""A call whose caller stopped waiting (deadline passed, cancelled) does nothing: the
check every ``mneme.v1`` call passes before its servicer runs
(:class:`mneme.grpc_util.ValidationInterceptor`, called with a stand-in context), and the
one before reflect's and search's API writes are appended (:mod:`mneme.bootstrap`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import grpc
import pytest

from mneme.grpc_util import ValidationInterceptor
from mneme.v1 import directives_pb2, reflect_pb2


class _Aborted(Exception):
    pass


class _Context:
    """A servicer context whose deadline and liveness the test sets."""

    def __init__(self, left: float | None, active: bool = True) -> None:
        self.left, self.active, self.status = left, active, None

    def time_remaining(self):
        return self.left

    def is_active(self) -> bool:
        return self.active

    def abort_with_status(self, status):
        self.status = status
        raise _Aborted


def _intercepted(method: str, behaviour, streaming: bool = False):
    make = (grpc.unary_stream_rpc_method_handler if streaming
            else grpc.unary_unary_rpc_method_handler)
    handler = ValidationInterceptor().intercept_service(
        lambda details: make(behaviour), SimpleNamespace(method=method))
    return handler.unary_stream if streaming else handler.unary_unary


@pytest.mark.parametrize("left, active, code", [(0.0, True, grpc.StatusCode.DEADLINE_EXCEEDED),
                                                (5.0, False, grpc.StatusCode.CANCELLED)])
def test_a_call_whose_deadline_passed_or_caller_left_before_it_started_does_nothing(
        left, active, code):
    """A write whose deadline had passed by the time a worker took it up (a 1 ms
    deadline, a queue of calls) was carried out all the same: the client was told
    DEADLINE_EXCEEDED while the directive, mental model, bank or retain was created, so a
    retry created it twice. Such a call, or one its caller cancelled meanwhile, ends with
    that status before the servicer runs."""
    ran = []
    request = directives_pb2.CreateDirectiveRequest(
        parent="banks/b", directive=directives_pb2.Directive(text="Be brief."))
    call = _intercepted("/mneme.v1.DirectiveService/CreateDirective",
                        lambda req, ctx: ran.append(req))
    ctx = _Context(left, active)
    with pytest.raises(_Aborted):
        call(request, ctx)
    assert ran == [] and ctx.status.code == code
    stream = _intercepted("/mneme.v1.ReflectService/StreamReflect",
                          lambda req, ctx: iter(ran.append(req) or ()), streaming=True)
    ctx = _Context(left, active)
    with pytest.raises(_Aborted):
        list(stream(reflect_pb2.ReflectRequest(parent="banks/b", query="q"), ctx))
    assert ran == [] and ctx.status.code == code


def test_a_call_with_time_left_or_no_deadline_runs():
    ran = []
    call = _intercepted("/mneme.v1.DirectiveService/CreateDirective",
                        lambda req, ctx: ran.append(req) or "done")
    request = directives_pb2.CreateDirectiveRequest(
        parent="banks/b", directive=directives_pb2.Directive(text="Be brief."))
    assert call(request, _Context(0.5)) == "done"
    assert call(request, _Context(None)) == "done"
    assert len(ran) == 2


def test_mental_model_and_entity_correction_writes_are_not_appended_once_the_caller_left():
    """reflect's and search's API writes (mental models, entity merges and splits) are
    appended only while the caller still waits, like ingest's."""
    import time

    from mneme import bootstrap, deadline
    from mneme.errors import Cancelled, DeadlineExceeded
    from mneme.events.v1 import events_pb2 as ev

    class Log:
        appended: list = []

        def append(self, records):
            self.appended += records
            return [SimpleNamespace(topic="t", partition=0, offset=0)]

    from mneme.slots import WaitSlots
    root = SimpleNamespace(log=Log(), raw_log=Log(), catalog=None, embedder=None,
                           distributed=True, group_id=lambda g: g, wait_slots=WaitSlots())
    parts = SimpleNamespace(routers={"search": SimpleNamespace(group_id="search")})
    models = bootstrap._mental_models(root, SimpleNamespace(reflect=None, revise=None),
                                      lambda bank: True, "mneme/reflect")
    corrections = bootstrap._entity_corrections(root, parts)
    writes = [lambda: models.append(ev.MentalModelChanged(bank_id="b", id="m"), "b"),
              lambda: corrections.append(ev.EntityMergeRequested(bank_id="b"), "b")]
    for gone in (deadline.Deadline(time.monotonic() - 1), deadline.Deadline(None, lambda: False)):
        with deadline.bind(gone):
            for write in writes:
                with pytest.raises((DeadlineExceeded, Cancelled)):
                    write()
    assert Log.appended == []
    for write in writes:  # no deadline: appended
        write()
    assert len(Log.appended) == 2


@pytest.mark.parametrize("error, what", [
    (__import__("sqlite3").OperationalError("database or disk is full"), "disk space"),
    (OSError(28, "No space left on device"), "disk space"),
    (OSError(24, "Too many open files"), "open files"),
    (ValueError("An IO error occurred: 'Too many open files (os error 24)'"), "open files"),
    (Exception("Service runtime error: failed to open file `x.tmp`: No space left on "
               "device (os error 28)"), "disk space")])
def test_a_call_failing_for_want_of_disk_space_or_open_files_is_resource_exhausted(error, what):
    """On a full disk or at the open-file limit a call failed UNKNOWN with the store's
    own message ("Exception calling application: database or disk is full"): it is
    RESOURCE_EXHAUSTED saying what the server ran out of, for unary and streaming calls."""

    def fail(req, ctx):
        raise error
    call = _intercepted("/mneme.v1.BankService/UpsertBank", fail)
    ctx = _Context(5.0)
    with pytest.raises(_Aborted):
        call(directives_pb2.CreateDirectiveRequest(parent="banks/b"), ctx)
    assert ctx.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert what in ctx.status.details
    from google.rpc import error_details_pb2, status_pb2
    details = status_pb2.Status.FromString(
        dict(ctx.status.trailing_metadata)["grpc-status-details-bin"]).details
    info = error_details_pb2.ErrorInfo()
    assert details[-1].Unpack(info)  # AIP-193, as every error mneme answers
    assert (info.reason, info.metadata["resource"]) == (
        "SERVER_OUT_OF_RESOURCES", what.replace(" ", "_"))
    stream = _intercepted("/mneme.v1.ReflectService/StreamReflect",
                          lambda req, ctx: (_ for _ in ()).throw(error), streaming=True)
    ctx = _Context(5.0)
    with pytest.raises(_Aborted):
        list(stream(reflect_pb2.ReflectRequest(parent="banks/b", query="q"), ctx))
    assert ctx.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_any_other_failure_passes_unchanged():
    def fail(req, ctx):
        raise RuntimeError("a bug")
    call = _intercepted("/mneme.v1.BankService/UpsertBank", fail)
    ctx = _Context(5.0)
    with pytest.raises(RuntimeError, match="a bug"):
        call(directives_pb2.CreateDirectiveRequest(parent="banks/b"), ctx)
    assert ctx.status is None


def test_a_request_error_quoting_such_words_is_not_taken_for_a_shortage():
    """Only the server's own failures count: a request error whose text happens to say
    "disk is full" (or an abort raised while handling one) stays what it is."""
    from mneme.errors import InvalidArgument, resource_shortage
    err = InvalidArgument("query", "'database or disk is full' is not a bank")
    assert resource_shortage(err) is None
    try:
        try:
            raise err
        except InvalidArgument:
            raise Exception()  # as grpc's context.abort raises inside the handler
    except Exception as abort:
        assert resource_shortage(abort) is None


def test_sqlite_unable_to_open_at_the_open_file_limit_is_a_shortage():
    """At the open-file limit SQLite answers "unable to open database file" (errno
    unsaid), which a Retain answered UNKNOWN: it is a shortage of open files when the
    process cannot open a file then, and an ordinary error otherwise."""
    import resource
    import sqlite3
    from mneme.errors import resource_shortage
    cantopen = sqlite3.OperationalError("unable to open database file")
    cantopen.sqlite_errorcode = sqlite3.SQLITE_CANTOPEN
    assert resource_shortage(cantopen) is None  # files to spare: a missing directory, say
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        try:
            while True:
                held.append(open(os.devnull))
        except OSError:
            pass
        assert resource_shortage(cantopen) == "open files"
    finally:
        for f in held:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_shortage_met_while_handling_a_request_error_is_still_one():
    """A write that fails for want of disk space inside ``except NotFound`` (create what
    was not found) is the shortage: the request error it was raised from does not hide it."""
    from mneme.errors import NotFound, resource_shortage
    try:
        try:
            raise NotFound("bank 'b' not found")
        except NotFound:
            raise OSError(28, "No space left on device")
    except OSError as e:
        assert resource_shortage(e) == "disk space"


def test_a_call_failing_while_a_store_server_is_unreachable_is_unavailable():
    """With the embedded graph server stopped, Recall and GetBankStats answered UNKNOWN
    ("Exception calling application: Timeout reading from socket"), which clients do not
    retry and which tells the operator nothing: it is UNAVAILABLE (retryable), saying a
    store of the server does not answer, with the client's error."""
    import redis.exceptions

    def fail(req, ctx):
        raise redis.exceptions.TimeoutError("Timeout reading from socket")
    call = _intercepted("/mneme.v1.BankService/UpsertBank", fail)
    ctx = _Context(5.0)
    with pytest.raises(_Aborted):
        call(directives_pb2.CreateDirectiveRequest(parent="banks/b"), ctx)
    assert ctx.status.code == grpc.StatusCode.UNAVAILABLE
    assert "store" in ctx.status.details and "Timeout reading from socket" in ctx.status.details
    from google.rpc import error_details_pb2, status_pb2
    details = status_pb2.Status.FromString(
        dict(ctx.status.trailing_metadata)["grpc-status-details-bin"]).details
    info = error_details_pb2.ErrorInfo()
    assert details[-1].Unpack(info) and info.reason == "STORE_UNAVAILABLE"
