"""The LLM gateway: every model call of mneme goes through :class:`LlmGateway`.

It adds what litellm leaves to the caller: the model of each operation (see
:mod:`mneme.llm.settings`), structured output by JSON schema with re-asking on
malformed/truncated replies, a per-attempt timeout, retries with exponential backoff and
jitter on 429/408/5xx, timeouts and connection errors (honouring ``Retry-After`` up to
the backoff cap; a tenacity policy from :mod:`mneme.retry`), a circuit breaker per endpoint
(:mod:`mneme.llm.breaker`: a model that keeps timing out or refusing connections fails
calls at once as LlmUnavailable instead of costing every call its timeouts and retries), a
process-wide concurrency limit, and token/cost accounting returned
with every result (:class:`Usage`) so callers can put it on the events they produce.

litellm is imported on first use (it takes seconds and reads the network for its price
list unless ``LITELLM_LOCAL_MODEL_COST_MAP`` is set, which :func:`load_litellm` does), so
a process without a configured model never imports it. Thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
import time
from typing import Awaitable, Callable, Iterable, Iterator

import tenacity

from mneme import retry, telemetry
from mneme.deadline import Deadline, current as current_deadline
from mneme.errors import Cancelled, DeadlineExceeded, quotes
from mneme.llm.breaker import OPEN, CircuitBreaker, CircuitOpen
from mneme.llm.jsonout import JsonOutputError, clean_text, parse_json, validate
from mneme.llm.metrics import METRICS
from mneme.llm.settings import Endpoint, LlmSettings
# The port's results, errors and helpers live in mneme.llm.types (no adapter code); they
# are re-exported here for the callers that import them from the gateway.
from mneme.llm.types import (Completion, Connectivity, JsonResult, LlmError, LlmNotConfigured,
                             LlmOutputError, LlmRequestError, LlmUnavailable, ToolCall, Usage,
                             dumps, tool_spec)

log = logging.getLogger("mneme.llm")

_litellm = None
_litellm_lock = threading.Lock()


def load_litellm():
    """Import and configure litellm once (local price map, no debug banners, no
    callbacks). Slow (~5–20 s): call it only on an LLM path."""
    global _litellm
    with _litellm_lock:
        if _litellm is None:
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            import litellm

            litellm.suppress_debug_info = True
            # The gateway logs failures itself (with the retry decision); litellm's own
            # error lines would duplicate them.
            logging.getLogger("LiteLLM").setLevel(logging.CRITICAL)
            _litellm = litellm
        return _litellm


# ---- bounded attempts ----------------------------------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0

#: How often a waiting model call looks whether its caller has gone (seconds).
_CALLER_POLL_S = 0.25


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop of model calls (a daemon thread, started on first use).
    Calls run on litellm's async client because only a task can be stopped mid-answer:
    the sync client's timeout bounds each socket read, so a server that sends a byte now
    and then (a stuck proxy, a model that never stops) kept a call, and its caller's
    thread, forever."""
    global _loop, _loop_pid
    with _litellm_lock:
        # a forked child has the parent's loop object but not its thread: start its own
        if _loop is None or _loop.is_closed() or _loop_pid != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="mneme-llm-calls",
                             daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


def run_bounded(make: Callable[[], Awaitable], seconds: float, call: Deadline,
                what: str = "model call"):
    """The result of the coroutine ``make()``, run on :func:`_event_loop`, cancelled (its
    HTTP connection closed) after ``seconds`` in all or as soon as ``call``'s caller has
    gone or its deadline passed. Raises TimeoutError (``seconds`` ran out), Cancelled /
    DeadlineExceeded (from ``call``), or what the coroutine raised."""
    fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make(), seconds), _event_loop())
    try:
        while True:
            done, _ = concurrent.futures.wait([fut], timeout=_CALLER_POLL_S)
            if done:
                try:
                    return fut.result()
                except TimeoutError as e:  # wait_for's: it says nothing by itself
                    raise TimeoutError(f"no complete answer within {seconds:.1f} s") from e
            call.check(what)
    except BaseException:
        fut.cancel()
        raise


_END = object()


async def _next_chunk(stream):
    """The stream's next chunk, or :data:`_END` (StopAsyncIteration does not cross a
    future)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


# ---- error text ----------------------------------------------------------------------------

#: Shortest secret masked (shorter values would mask ordinary words).
_MIN_SECRET = 8


def redact(text: str, settings: LlmSettings) -> str:
    """``text`` with every model API key mneme knows masked (the ``MNEME_*_API_KEY``
    settings and the provider variables litellm reads, ``*_API_KEY``), as ``…`` plus its
    last 4 characters. A provider or proxy that quotes a rejected key would otherwise
    put it in logs, an item's failure on the event log and the operation's error."""
    keys = {v.get_secret_value() for k, v in settings if k.endswith("api_key") and v}
    keys |= {v for k, v in os.environ.items() if k.endswith("API_KEY") and v}
    for key in sorted((k for k in keys if len(k) >= _MIN_SECRET), key=len, reverse=True):
        if key in text:
            text = text.replace(key, "…" + key[-4:])
    return text


def _texts(messages: Iterable[dict]) -> list[str]:
    """The text contents of chat ``messages`` (a content given as parts: its text parts;
    a tool call's arguments)."""
    out: list[str] = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out += [p.get("text") or "" for p in c if isinstance(p, dict)]
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict):
                out.append(str(fn.get("arguments") or ""))
    return out


# ---- error classification ------------------------------------------------------------------


class MalformedResponse(Exception):
    """A provider's 200 answer without the parts every answer has (no ``choices``, a
    choice without a message, a rerank result without a usable index): a fault of that
    answer, retried like a 5xx (the next one is usually whole)."""


def _classify(exc: Exception) -> tuple[str, bool]:
    """(reason, retryable) of an exception litellm raised."""
    if isinstance(exc, MalformedResponse):
        return "malformed", True
    if isinstance(exc, TimeoutError):  # run_bounded's limit on the whole attempt
        return "timeout", True
    name = type(exc).__name__
    code = getattr(exc, "status_code", None)
    if name in ("Timeout", "APITimeoutError") or code == 408:
        return "timeout", True
    if code == 429 or name == "RateLimitError":
        return "rate_limited", True
    if name == "ContextWindowExceededError":
        return "context_window", False
    if name in ("AuthenticationError", "PermissionDeniedError") or code in (401, 403):
        return "auth", False
    text = str(exc).lower()
    if "api key" in text and ("required" in text or "missing" in text):
        return "auth", False  # a missing key surfaces as a connection error: not transient
    if isinstance(code, int) and code >= 500:
        return "unavailable", True
    if name in ("APIConnectionError", "ServiceUnavailableError", "InternalServerError",
                "BadGatewayError", "MidStreamFallbackError"):
        return "unavailable", True  # no HTTP answer at all: the server is down or unreachable
    module = type(exc).__module__.split(".")[0]
    if code is None and module in ("litellm", "openai", "httpx", "httpcore"):
        return "unavailable", True  # a transport error without a status
    return "rejected", False  # 4xx, or a bug: retrying would not help


def _retry_after(exc: Exception) -> float | None:
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None)
    if not headers:
        return None
    try:
        return float(headers.get("retry-after"))
    except (TypeError, ValueError):
        return None


def _read_completion(resp) -> tuple[str, str, list[ToolCall]]:
    """(text, finish_reason, tool calls) of a chat completion, their text
    :func:`~mneme.llm.jsonout.clean_text`'d. Raises MalformedResponse when it has no
    choice or its choice no message."""
    choice = next(iter(getattr(resp, "choices", None) or []), None)
    msg = getattr(choice, "message", None)
    if msg is None:
        raise MalformedResponse("the model's answer has no choices or no message")
    calls = []
    for i, tc in enumerate(getattr(msg, "tool_calls", None) or []):
        fn = getattr(tc, "function", None)
        calls.append(ToolCall(getattr(tc, "id", None) or f"call_{i}",
                              str(getattr(fn, "name", None) or ""),
                              clean_text(str(getattr(fn, "arguments", None) or "{}"))))
    content = msg.content if isinstance(msg.content, str) else ""
    return clean_text(content), choice.finish_reason or "stop", calls


def _read_rerank(resp, n: int) -> list[tuple[int, float]]:
    """``[(document index, relevance score)]`` of a rerank answer over ``n`` documents.
    A result whose index is no integer in ``[0, n)`` or whose score is no finite number
    is left out (its document keeps its place, as one the server did not score), and so
    is a second result for one index."""
    out: dict[int, float] = {}
    for r in getattr(resp, "results", None) or []:
        get = r.get if isinstance(r, dict) else (lambda k, r=r: getattr(r, k, None))
        i, score = get("index"), get("relevance_score")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n or i in out:
            continue
        if isinstance(score, bool) or not isinstance(score, (int, float)) \
                or not math.isfinite(score):
            continue
        out[i] = float(score)
    return list(out.items())


# ---- the gateway ---------------------------------------------------------------------------


class LlmGateway:
    """Model calls per operation (retain, reflect, consolidation, rerank) with the
    settings' timeouts, retries, concurrency limit and accounting (see the module docs).

    ``sleep`` and ``clock`` (monotonic seconds, the breakers' cool-downs) are injectable
    so tests need not wait out real backoffs."""

    def __init__(self, settings: LlmSettings | None = None, sleep=time.sleep,
                 clock=time.monotonic):
        self.settings = settings or LlmSettings()
        self._sem = threading.BoundedSemaphore(self.settings.llm_max_concurrency)
        self._sleep = sleep
        self._clock = clock
        self._breakers: dict[tuple[str, str], CircuitBreaker] = {}
        self._breakers_lock = threading.Lock()

    # ---- configuration ---------------------------------------------------------------

    def endpoint(self, operation: str) -> Endpoint | None:
        return self.settings.endpoint(operation)

    def configured(self, operation: str) -> bool:
        """True when ``operation`` has a model (never imports litellm)."""
        return self.settings.endpoint(operation) is not None

    def _require(self, operation: str) -> Endpoint:
        ep = self.settings.endpoint(operation)
        if ep is None:
            raise LlmNotConfigured(f"no model configured for {operation} "
                                   f"(MNEME_{operation.upper()}_LLM_MODEL or MNEME_LLM_MODEL)")
        return ep

    # ---- the circuit breakers --------------------------------------------------------

    def breaker(self, ep: Endpoint) -> CircuitBreaker:
        """The circuit breaker of ``ep``'s endpoint (model and base URL: operations sharing
        a model server share its breaker), made on first use from the settings'
        ``llm_breaker_failures`` and ``llm_breaker_cooldown_s``."""
        key = (ep.model, ep.base_url or "")
        with self._breakers_lock:
            b = self._breakers.get(key)
            if b is None:
                name = ep.model if not ep.base_url else f"{ep.model} at {ep.base_url}"
                b = self._breakers[key] = CircuitBreaker(
                    name, self.settings.llm_breaker_failures,
                    self.settings.llm_breaker_cooldown_s, self._clock,
                    on_open=lambda _n, m=ep.model: METRICS.add("mneme.llm.breaker.opened",
                                                               model=m))
            return b

    def _guarded(self, breaker: CircuitBreaker, fn, t: float, cut: bool, call: Deadline):
        """``fn(t)`` admitted by ``breaker`` (raises CircuitOpen, no call made; behind a
        half-open trial it waits up to ``t`` while ``call``'s caller waits), its outcome
        told to it: a timeout, connection error or 5xx counts, unless the timeout was the
        caller's own (``cut``: ``t`` is what was left of the caller's deadline); answers
        close it; rejections, malformed answers and the caller's cancel count for nothing."""
        trial = breaker.acquire(t, lambda: call.check("model call behind a trial call"))
        told = False
        try:
            result = fn(t)
        except Exception as exc:
            if not isinstance(exc, (DeadlineExceeded, Cancelled)):
                reason, transient = _classify(exc)
                if transient and (reason == "unavailable" or (reason == "timeout" and not cut)):
                    breaker.failure(trial, reason)
                    told = True
            raise
        else:
            breaker.success(trial)
            told = True
            return result
        finally:
            if not told:
                breaker.release(trial)

    # ---- the retry policy ------------------------------------------------------------

    def _retrying(self, operation: str, ep: Endpoint, call,
                  breaker: CircuitBreaker | None = None) -> tenacity.Retrying:
        """The retry policy of one model call: transient errors (:func:`_classify`) are
        retried up to ``llm_max_retries`` times while ``breaker`` admits calls (an opened
        breaker ends the retries at once); retry *n* waits ``min(llm_backoff_max_s,
        llm_backoff_s * 2**(n-1))`` s ±20 % jitter, raised to ``Retry-After`` (capped at
        ``llm_backoff_max_s``) and cut to the caller's deadline ``call``; the last error
        is re-raised as is."""
        st = self.settings

        def before_sleep(rs: tenacity.RetryCallState) -> None:
            reason, _ = _classify(rs.outcome.exception())
            METRICS.add("mneme.llm.retries", operation=operation, reason=reason)
            log.info("%s call to %s: %s, retry %d in %.1fs", operation, ep.model, reason,
                     rs.attempt_number, rs.upcoming_sleep)

        wait = retry.at_least_hint(retry.backoff(st.llm_backoff_s, st.llm_backoff_max_s, 0.2),
                                   _retry_after, st.llm_backoff_max_s)
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: not isinstance(exc, (DeadlineExceeded, Cancelled, CircuitOpen))
                and _classify(exc)[1] and (breaker is None or breaker.admits())),
            stop=tenacity.stop_after_attempt(st.llm_max_retries + 1),
            wait=retry.within_deadline(wait, call), sleep=self._sleep,
            before_sleep=before_sleep, reraise=True)

    def _words(self, exc: Exception, sent: Iterable[str]) -> tuple[str, bool]:
        """What an error message may say of the provider's error ``exc`` (API keys masked,
        at most 300 characters), and whether its words were left out because they quote
        the request's texts ``sent`` (:func:`quotes`; then only the HTTP status is said)."""
        words = redact(str(exc), self.settings)
        if not quotes(words, sent):
            return words[:300], False
        code = getattr(exc, "status_code", None)
        return ((f"HTTP {code}, " if isinstance(code, int) else "")
                + "the provider's message quotes the request: not repeated"), True

    def _call(self, operation: str, ep: Endpoint, fn, timeout: float | None = None,
              hold: bool = True, sent: Iterable[str] = ()):
        """Run ``fn(timeout)`` (one HTTP attempt) under the semaphore (``hold=False``: the
        caller holds it), retrying transient failures by :meth:`_retrying`. Each attempt
        first checks the caller's deadline (raising DeadlineExceeded / Cancelled: no
        attempt) and gets at most the time left as its timeout, then passes the endpoint's
        circuit breaker (:meth:`breaker`; checked once the semaphore is held, so calls that
        queued behind a dying model's fail at once too). Returns (result, usage of the
        attempts without tokens). Raises LlmUnavailable (reason ``unavailable`` and no call
        made when the breaker is open) / LlmRequestError, whose message quotes the
        provider's unless that quotes the request's texts ``sent`` (:func:`mneme.errors.quotes`)."""
        timeout = timeout or self.settings.llm_timeout_s
        usage = Usage(model=ep.model)
        call = current_deadline()  # the gRPC caller's, when a request is being served
        breaker = self.breaker(ep)
        attempts = 0

        def attempt():
            nonlocal attempts
            call.check(f"{operation} model call")  # the caller stopped waiting: no attempt
            left = call.remaining()
            attempt_timeout = timeout if left is None else max(0.001, min(timeout, left))
            cut = attempt_timeout < timeout  # a timeout now is the caller's deadline
            attempts += 1
            t0 = time.monotonic()
            try:
                with telemetry.span(f"llm {operation}", telemetry.SpanKind.CLIENT,
                                    gen_ai__operation__name=operation,
                                    gen_ai__request__model=ep.model,
                                    mneme__llm__attempt=attempts):
                    if hold:
                        with self._sem:
                            result = self._guarded(breaker, fn, attempt_timeout, cut, call)
                    else:
                        result = self._guarded(breaker, fn, attempt_timeout, cut, call)
            except CircuitOpen:
                attempts -= 1  # no call was made
                raise
            except Exception:
                usage.failed_calls += 1
                usage.latency_s += time.monotonic() - t0
                raise
            usage.calls += 1
            usage.latency_s += time.monotonic() - t0
            return result

        try:
            return self._retrying(operation, ep, call, breaker)(attempt), usage
        except (DeadlineExceeded, Cancelled):
            raise
        except CircuitOpen as exc:
            METRICS.add("mneme.llm.requests", operation=operation, model=ep.model,
                        outcome="error")
            METRICS.add("mneme.llm.breaker.rejected", operation=operation, model=ep.model)
            done = f"failed after {attempts} attempt(s)" if attempts else "not made"
            msg = f"{operation} call to {ep.model} {done}: {exc}"
            log.info(msg)
            raise LlmUnavailable(msg, "unavailable", usage) from exc
        except Exception as exc:  # litellm maps every provider error to its own classes
            reason, retryable = _classify(exc)
            METRICS.add("mneme.llm.requests", operation=operation, model=ep.model,
                        outcome="error")
            words, quoted = self._words(exc, sent)
            msg = f"{operation} call to {ep.model} failed ({reason}) after " \
                  f"{attempts} attempt(s): {type(exc).__name__}: {words}"
            log.warning(msg)
            cls = LlmUnavailable if retryable else LlmRequestError
            if quoted:  # nor through the chained error a traceback would print
                raise cls(msg, reason, usage) from None
            raise cls(msg, reason, usage) from exc

    def _account(self, operation: str, ep: Endpoint, usage: Usage, response) -> None:
        """Fill tokens and cost of ``response`` into ``usage`` and the metrics."""
        u = getattr(response, "usage", None)
        usage.input_tokens += int(getattr(u, "prompt_tokens", 0) or 0)
        usage.output_tokens += int(getattr(u, "completion_tokens", 0) or 0)
        cost = 0.0
        try:
            cost = float(load_litellm().completion_cost(completion_response=response) or 0.0)
        except Exception:  # unpriced model (local server, stub): cost unknown → 0
            cost = 0.0
        usage.cost_usd += cost
        METRICS.add("mneme.llm.requests", operation=operation, model=ep.model, outcome="ok")
        METRICS.add("mneme.llm.tokens", usage.input_tokens, operation=operation, model=ep.model,
                    direction="input")
        METRICS.add("mneme.llm.tokens", usage.output_tokens, operation=operation, model=ep.model,
                    direction="output")
        METRICS.add("mneme.llm.cost", cost, operation=operation, model=ep.model)

    def _kwargs(self, ep: Endpoint, messages, tools, tool_choice, response_schema, schema_name,
                strict, max_tokens, temperature) -> dict:
        kw: dict = {"model": ep.model, "messages": messages,
                    "max_tokens": max_tokens or self.settings.llm_max_output_tokens,
                    # our retry policy is the only one: no hidden SDK retries under it
                    "num_retries": 0, "max_retries": 0, "drop_params": True}
        if ep.base_url:
            kw["api_base"] = ep.base_url
        if ep.api_key:
            kw["api_key"] = ep.api_key
        if temperature is not None:
            kw["temperature"] = temperature
        if tools:
            kw["tools"] = tools
            if tool_choice:
                kw["tool_choice"] = tool_choice
        mode = self.settings.llm_json_mode
        if response_schema is not None and mode == "schema":
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema_name, "schema": response_schema, "strict": strict}}
        elif response_schema is not None and mode == "object":
            kw["response_format"] = {"type": "json_object"}
        return kw

    # ---- calls -------------------------------------------------------------------------

    def complete(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
                 tool_choice: str | None = None, response_schema: dict | None = None,
                 schema_name: str = "output", strict: bool = True, max_tokens: int | None = None,
                 temperature: float | None = None, timeout: float | None = None) -> Completion:
        """One chat completion (retried on transient errors). ``messages`` are OpenAI-style
        dicts; ``tools`` OpenAI function specs; ``response_schema`` asks for JSON output by
        the settings' ``llm_json_mode`` (the reply is *not* parsed here: see
        :meth:`complete_json`). Raises LlmNotConfigured, LlmUnavailable, LlmRequestError."""
        ep = self._require(operation)
        kw = self._kwargs(ep, messages, tools, tool_choice, response_schema, schema_name, strict,
                          max_tokens, temperature)
        litellm = load_litellm()

        call = current_deadline()

        def attempt(t: float):
            resp = run_bounded(lambda: litellm.acompletion(timeout=t, **kw), t, call,
                               f"{operation} model call")
            return resp, _read_completion(resp)  # a malformed answer fails the attempt
        (resp, (text, finish, calls)), usage = self._call(operation, ep, attempt, timeout,
                                                          sent=_texts(messages))
        self._account(operation, ep, usage, resp)
        return Completion(text, finish, calls, usage)

    def stream(self, operation: str, messages: list[dict], *, tools: list[dict] | None = None,
               tool_choice: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None,
               timeout: float | None = None) -> Iterator["str | Completion"]:
        """Streaming chat completion: yields text deltas (str) as they arrive and, last,
        the assembled :class:`Completion` (tool calls merged from their deltas, usage from
        the final chunk). Transient errors are retried only until the first delta arrived;
        after that they raise LlmUnavailable (a partial answer cannot be taken back)."""
        ep = self._require(operation)
        kw = self._kwargs(ep, messages, tools, tool_choice, None, "", True, max_tokens, temperature)
        kw.update(stream=True, stream_options={"include_usage": True})
        litellm = load_litellm()
        with self._sem:  # held while the stream is read: it occupies the server as long
            yield from self._stream(operation, ep, litellm, kw, timeout)

    def _stream(self, operation, ep, litellm, kw, timeout):
        call = current_deadline()
        what = f"{operation} model stream"
        # the whole stream, not each chunk, is bounded by the call's timeout
        end = time.monotonic() + (timeout or self.settings.llm_timeout_s)
        stream, usage = self._call(
            operation, ep, lambda t: run_bounded(lambda: litellm.acompletion(timeout=t, **kw),
                                                 t, call, what), timeout, hold=False,
            sent=_texts(kw["messages"]))
        text: list[str] = []
        calls: dict[int, dict] = {}
        finish = "stop"
        last_usage = None

        def chunks():
            try:
                while True:
                    left = max(0.001, end - time.monotonic())
                    if call.remaining() is not None:
                        left = max(0.001, min(left, call.remaining()))
                    chunk = run_bounded(lambda: _next_chunk(stream), left, call, what)
                    if chunk is _END:
                        return
                    yield chunk
            finally:  # ended, broken or abandoned by its reader: release the connection
                close = getattr(stream, "aclose", None)
                if close is not None:
                    asyncio.run_coroutine_threadsafe(close(), _event_loop())
        # the high half of a surrogate pair a chunk ends on, held for the next chunk (a
        # server that cuts its text by UTF-16 units splits an emoji's escape in two)
        held = ""
        try:
            for chunk in chunks():
                if getattr(chunk, "usage", None) is not None:
                    last_usage = chunk
                for choice in chunk.choices or []:
                    delta = choice.delta
                    if getattr(delta, "content", None):
                        raw = held + delta.content
                        held = raw[-1] if "\ud800" <= raw[-1] <= "\udbff" else ""
                        piece = clean_text(raw[:len(raw) - len(held)])
                        if piece:
                            text.append(piece)
                            yield piece
                    for tc in getattr(delta, "tool_calls", None) or []:
                        c = calls.setdefault(tc.index or 0, {"id": "", "name": "", "arguments": ""})
                        c["id"] = tc.id or c["id"]
                        if tc.function is not None:
                            if tc.function.name and not c["name"]:
                                c["name"] = tc.function.name
                            c["arguments"] += tc.function.arguments or ""
                    if choice.finish_reason:
                        finish = choice.finish_reason
        except (DeadlineExceeded, Cancelled):
            raise
        except Exception as exc:
            reason, _ = _classify(exc)
            METRICS.add("mneme.llm.requests", operation=operation, model=ep.model, outcome="error")
            words, quoted = self._words(exc, _texts(kw["messages"]))
            err = LlmUnavailable(f"{operation} stream from {ep.model} broke ({reason}): {words}",
                                 reason, usage)
            if quoted:  # nor through the chained error a traceback would print
                raise err from None
            raise err from exc
        if held:  # the stream ended on half a pair
            text.append(clean_text(held))
            yield text[-1]
        if last_usage is not None:
            self._account(operation, ep, usage, last_usage)
        tool_calls = [ToolCall(c["id"] or f"call_{i}", c["name"] or "",
                               clean_text(c["arguments"] or "{}"))
                      for i, c in sorted(calls.items())]
        yield Completion(clean_text("".join(text)), finish, tool_calls, usage)

    def complete_json(self, operation: str, messages: list[dict], schema: dict, *,
                      check_schema: dict | None = None, schema_name: str = "output",
                      strict: bool = True,
                      max_tokens: int | None = None, temperature: float | None = 0.0,
                      timeout: float | None = None) -> JsonResult:
        """A reply that parses as JSON and validates against ``schema``. Lenient parsing
        repairs fences, surrounding prose, trailing commas and missing final brackets
        (:func:`mneme.llm.jsonout.parse_json`); otherwise the model is re-asked up to
        ``llm_json_retries`` times, told what was wrong. ``check_schema`` (default
        ``schema``) is what the reply is validated against locally: callers pass a laxer
        one when they normalise missing optional fields themselves, since models without
        schema-constrained decoding often leave them out. A truncated reply (finish_reason
        ``length``) is re-asked with twice the token cap (up to ``llm_max_output_tokens``).
        Raises LlmOutputError (reason malformed/schema/truncated, with the usage of all
        attempts) and the errors of :meth:`complete`."""
        cap = self.settings.llm_max_output_tokens
        limit = min(max_tokens or cap, cap)
        usage = Usage()
        convo = list(messages)
        reason, detail = "malformed", ""
        attempts = 1 + self.settings.llm_json_retries
        for attempt in range(1, attempts + 1):
            try:
                c = self.complete(operation, convo, response_schema=schema, schema_name=schema_name,
                                  strict=strict, max_tokens=limit, temperature=temperature,
                                  timeout=timeout)
            except LlmError as e:
                e.usage = usage.add(e.usage)
                raise
            usage.add(c.usage)
            if c.truncated:
                reason, detail = "truncated", f"reply cut off at the {limit}-token limit"
                METRICS.add("mneme.llm.output_errors", operation=operation, reason=reason)
                if limit >= cap:
                    break  # the same cap would cut it off again: let the caller split the input
                limit = min(cap, limit * 2)
                continue
            try:
                value = parse_json(c.text)
                validate(value, schema if check_schema is None else check_schema)
                return JsonResult(value, usage, attempt)
            except JsonOutputError as e:
                reason, detail, hint = e.reason, str(e), e.hint
                METRICS.add("mneme.llm.output_errors", operation=operation, reason=reason)
                log.info("%s: unusable reply (%s: %s), attempt %d/%d", operation, reason, detail,
                         attempt, attempts)
                convo = list(messages) + [
                    {"role": "assistant", "content": (c.text or "")[:4000]},
                    {"role": "user", "content": f"Your reply was not usable: {hint}. Reply again "
                                                "with only the JSON object, matching the schema exactly."}]
        raise LlmOutputError(f"{operation}: {detail}", reason, usage)

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None) -> tuple[list[tuple[int, float]], Usage]:
        """Cross-encoder scores of ``documents`` for ``query`` through ``litellm.rerank``:
        ``[(document index, relevance score)]`` best first, and the usage (rerank reports
        tokens only). Uses ``rerank_timeout_s`` and the same retries (fewer are wise on a
        hot path: set ``MNEME_LLM_MAX_RETRIES``). Raises LlmNotConfigured / LlmUnavailable /
        LlmRequestError."""
        ep = self._require("rerank")
        litellm = load_litellm()
        kw: dict = {"model": ep.model, "query": query, "documents": documents,
                    "top_n": top_n or len(documents), "return_documents": False}
        if ep.base_url:
            kw["api_base"] = ep.base_url
        if ep.api_key:
            kw["api_key"] = ep.api_key
        call = current_deadline()
        resp, usage = self._call(
            "rerank", ep, lambda t: run_bounded(lambda: litellm.arerank(timeout=t, **kw), t, call,
                                                "rerank model call"),
            self.settings.rerank_timeout_s, sent=[query, *documents])
        results = _read_rerank(resp, len(documents))
        meta = getattr(resp, "meta", None) or {}
        tokens = ((meta.get("tokens") or {}).get("input_tokens") if isinstance(meta, dict) else 0) or 0
        usage.input_tokens += int(tokens)
        METRICS.add("mneme.llm.requests", operation="rerank", model=ep.model, outcome="ok")
        METRICS.add("mneme.llm.tokens", usage.input_tokens, operation="rerank", model=ep.model,
                    direction="input")
        results.sort(key=lambda p: -p[1])
        return results, usage

    # ---- connectivity --------------------------------------------------------------------

    def check(self, operations: tuple[str, ...] | None = None) -> list["Connectivity"]:
        """Probe each configured operation's model with one tiny call (no retries):
        a one-word chat completion, or a two-document rerank. ``operations`` default: every
        configured one. The probe goes past the endpoint's circuit breaker; while that is
        open the result is not ok and its error says so (calls fail at once), followed by
        what the probe found. Never raises; see :class:`Connectivity`."""
        ops = operations or tuple(o for o in ("retain", "reflect", "consolidation", "rerank")
                                  if self.configured(o))
        out = []
        for op in ops:
            ep = self.settings.endpoint(op)
            if ep is None:
                out.append(Connectivity(op, "", False, 0.0, "no model configured"))
                continue
            probe = LlmGateway(self.settings.model_copy(
                update={"llm_max_retries": 0, "llm_breaker_failures": 0}), self._sleep)
            t0 = time.monotonic()
            try:
                if op == "rerank":
                    probe.rerank("ping", ["ping", "pong"])
                else:
                    probe.complete(op, [{"role": "user", "content": "Reply with the single word OK."}],
                                   max_tokens=5, timeout=min(30.0, self.settings.llm_timeout_s))
                ok, error = True, ""
            except LlmError as e:
                ok, error = False, str(e)
            latency = time.monotonic() - t0
            breaker = self.breaker(ep)
            if breaker.state() == OPEN:
                found = error or f"answered in {latency:.2f} s"
                ok, error = False, f"{breaker.describe()} (a probe just now: {found})"
            out.append(Connectivity(op, ep.model, ok, latency, error))
        return out


__all__ = [
    "Completion", "Connectivity", "JsonResult", "LlmError", "LlmGateway", "LlmNotConfigured",
    "LlmOutputError", "LlmRequestError", "LlmUnavailable", "ToolCall", "Usage", "dumps",
    "load_litellm", "tool_spec",
]
