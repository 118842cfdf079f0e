"""The gateway's circuit breaker per model endpoint (mneme.llm.breaker), over real HTTP
against the stub: a model that never answers costs its calls their timeouts only until the
breaker opens, then calls fail at once as LlmUnavailable (reason unavailable) without a
request; after the cool-down one trial goes through and its answer closes the breaker;
rejections (4xx, 429) and the caller's own cancel or deadline do not count."""

from __future__ import annotations

import threading

import pytest

from mneme import deadline
from mneme.errors import Cancelled, DeadlineExceeded
from mneme.llm import LlmGateway, LlmRequestError, LlmUnavailable, METRICS
from tests.llm.conftest import make_settings
from tests.llm.stub import Rule, chat, computed, gate, status
from tests.llm.test_operations_cancel_retry import until

MSGS = [{"role": "user", "content": "give x"}]


class Clock:
    """A monotonic clock the test moves (the breakers' cool-downs)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gateway(stub, clock=None, **overrides) -> LlmGateway:
    values = dict(llm_timeout_s=0.3, llm_max_retries=2, llm_breaker_failures=3,
                  llm_breaker_cooldown_s=30.0)
    values.update(overrides)
    return LlmGateway(make_settings(stub, **values), sleep=lambda s: None,
                      clock=clock or Clock())


@pytest.fixture
def held():
    """The stub's held requests (a model that never answers) are let go at the end."""
    ev = threading.Event()
    yield ev
    ev.set()


def never_answers(stub, held, healthy: threading.Event | None = None):
    """Every chat request is held past the client's timeout (until ``healthy`` is set:
    then answered)."""
    stub.on("chat", computed(lambda r: chat("OK") if healthy is not None and healthy.is_set()
                             else gate(held)), forever=True)


def test_a_model_that_always_times_out_opens_the_breaker_and_later_calls_fail_at_once(stub, held):
    never_answers(stub, held)
    gw = gateway(stub)
    with pytest.raises(LlmUnavailable) as first:
        gw.complete("retain", MSGS)
    assert first.value.reason == "timeout"
    # the attempts of the first call opened it (counted by the gateway: an attempt cut at
    # its 0.3 s on a busy machine may end before its request reaches the stub)
    assert first.value.usage.failed_calls == 3
    sent = len(stub.chat_requests())
    assert 1 <= sent <= 3
    for _ in range(20):
        with pytest.raises(LlmUnavailable) as e:
            gw.complete("retain", MSGS)
        assert e.value.reason == "unavailable" and "circuit open" in str(e.value)
        assert e.value.usage.failed_calls == 0 and e.value.usage.calls == 0
    assert len(stub.chat_requests()) == sent  # no request while open
    assert METRICS.get("mneme.llm.breaker.opened") == 1
    assert METRICS.get("mneme.llm.breaker.rejected", operation="retain") == 20
    # another operation on the same endpoint shares its breaker
    with pytest.raises(LlmUnavailable, match="circuit open"):
        gw.complete("reflect", MSGS)
    assert len(stub.chat_requests()) == sent


def test_retries_stop_as_soon_as_the_breaker_opens(stub, held):
    never_answers(stub, held)
    gw = gateway(stub, llm_max_retries=4, llm_breaker_failures=2)
    with pytest.raises(LlmUnavailable) as e:
        gw.complete("retain", MSGS)
    # not the 5 attempts of the retry policy (an attempt cut at its timeout on a busy
    # machine may end before its request reaches the stub, hence the gateway's count)
    assert e.value.usage.failed_calls == 2 and len(stub.chat_requests()) <= 2


def test_after_the_cool_down_one_trial_goes_through_and_an_answer_closes_it(stub, held):
    healthy = threading.Event()
    never_answers(stub, held, healthy)
    clock = Clock()
    gw = gateway(stub, clock, llm_max_retries=0, llm_breaker_failures=2)
    for _ in range(2):
        with pytest.raises(LlmUnavailable, match="timeout"):
            gw.complete("retain", MSGS)
    with pytest.raises(LlmUnavailable, match="circuit open"):
        gw.complete("retain", MSGS)
    (check,) = gw.check(("retain",))  # an operator sees it
    assert not check.ok and "circuit open" in check.error, check

    clock.now += 30.0  # the cool-down is over: the trial still times out, it reopens
    with pytest.raises(LlmUnavailable, match="timeout"):
        gw.complete("retain", MSGS)
    with pytest.raises(LlmUnavailable, match="circuit open"):
        gw.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 3 + 1  # two failures, one probe of the check, one trial

    healthy.set()
    clock.now += 30.0  # a healthy model's answer to the trial closes it
    assert gw.complete("retain", MSGS).text == "OK"
    assert [gw.complete("retain", MSGS).text for _ in range(3)] == ["OK"] * 3
    assert gw.breaker(gw.endpoint("retain")).state() == "closed"
    (check,) = gw.check(("retain",))
    assert check.ok and check.error == ""
    assert METRICS.get("mneme.llm.breaker.opened") == 2


def test_rejections_do_not_open_the_breaker(stub):
    stub.on("chat", status(400, "bad request"), status(404, "no such model"),
            status(422, "unprocessable"), status(401, "bad key"), status(429), status(429),
            status(429), status(429), chat("OK"))
    gw = gateway(stub, llm_max_retries=0, llm_breaker_failures=1)
    for _ in range(4):
        with pytest.raises(LlmRequestError):
            gw.complete("retain", MSGS)
    for _ in range(4):
        with pytest.raises(LlmUnavailable, match="rate_limited"):
            gw.complete("retain", MSGS)
    assert gw.complete("retain", MSGS).text == "OK"
    assert len(stub.chat_requests()) == 9 and METRICS.get("mneme.llm.breaker.opened") == 0


def test_server_errors_open_the_breaker(stub):
    stub.on("chat", status(503), status(500), status(502))
    gw = gateway(stub, llm_max_retries=1, llm_breaker_failures=3)
    with pytest.raises(LlmUnavailable):
        gw.complete("retain", MSGS)
    with pytest.raises(LlmUnavailable) as e:  # one more 5xx opens it: the retry is not made
        gw.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 3
    with pytest.raises(LlmUnavailable, match="circuit open"):
        gw.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 3 and e.value.reason == "unavailable"


def test_a_callers_cancel_or_deadline_does_not_count(stub, held):
    gone = threading.Event()
    # the first request: the caller goes away while the model holds it
    stub.on("chat", computed(lambda r: (threading.Timer(0.2, gone.set).start(), gate(held))[1]))
    never_answers(stub, held)
    gw = gateway(stub, llm_timeout_s=30.0, llm_max_retries=0, llm_breaker_failures=1)
    with deadline.bind(deadline.Deadline(None, lambda: not gone.is_set())):
        with pytest.raises(Cancelled):
            gw.complete("retain", MSGS)
    with deadline.bind(deadline.Deadline.after(0.3)):  # the caller's deadline, not the model's
        with pytest.raises((DeadlineExceeded, LlmUnavailable)):
            gw.complete("retain", MSGS)
    assert gw.breaker(gw.endpoint("retain")).state() == "closed"
    # the model's own timeout does count: one opens it (failures=1)
    with pytest.raises(LlmUnavailable, match="timeout"):
        gw.complete("retain", MSGS, timeout=0.3)
    with pytest.raises(LlmUnavailable, match="circuit open"):
        gw.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 3


def test_zero_disables_the_breaker(stub, held):
    never_answers(stub, held)
    gw = gateway(stub, llm_max_retries=0, llm_breaker_failures=0)
    for _ in range(4):
        with pytest.raises(LlmUnavailable, match="timeout"):
            gw.complete("retain", MSGS)
    assert len(stub.chat_requests()) == 4


def test_calls_behind_a_half_open_trial_wait_for_its_outcome(stub, held):
    """After an outage the items of a retried batch reach the breaker together: the one
    trial decides for all of them (before: the others failed at once beside it)."""
    healthy = threading.Event()
    never_answers(stub, held, healthy)
    clock = Clock()
    gw = gateway(stub, clock, llm_max_retries=0, llm_breaker_failures=1, llm_timeout_s=0.3)
    with pytest.raises(LlmUnavailable, match="timeout"):
        gw.complete("retain", MSGS)
    let_go = threading.Event()
    stub.rules.insert(0, Rule("chat", None, [gate(let_go, chat("OK"))]))  # the trial's reply
    healthy.set()
    clock.now += 30.0
    results: list = []

    def call():
        try:
            results.append(gw.complete("retain", MSGS, timeout=20.0).text)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            results.append(e)
    trial = threading.Thread(target=call)
    trial.start()
    until(lambda: len(stub.chat_requests()) == 2, "the trial call")
    others = [threading.Thread(target=call) for _ in range(2)]
    for t in others:
        t.start()
    others[0].join(0.5)
    assert all(t.is_alive() for t in others)  # waiting, not failed at once
    let_go.set()
    for t in [trial, *others]:
        t.join(30)
    assert results == ["OK"] * 3 and len(stub.chat_requests()) == 4
