"""A local OpenAI-compatible stub server for the LLM tests (stdlib ``http.server``).

Routes: ``POST /v1/chat/completions`` (plain and ``stream: true`` as SSE),
``POST /rerank`` (litellm's ``hosted_vllm/``), ``/v1/rerank`` and ``/v2/rerank``
(``cohere/``), all in the Cohere shape, ``POST /v1/embeddings``.
Each request is answered by the first *rule* of its route whose ``match`` substring occurs
in the raw request body and which still has scripted replies; rules pop their replies in
order. A request no rule answers gets HTTP 500 ``{"error": "unscripted"}``, so a test never
hangs on a missing script. Every request is recorded (:attr:`StubLLM.requests`) for
assertions on prompts.

Replies (see the factory functions): :func:`chat` (content, tool calls, finish_reason,
usage), :func:`status` (HTTP error codes such as 429/500/503, optional Retry-After),
:func:`delay` (sleep, then another reply: provokes client timeouts), :func:`gate` (wait
for the test's signal, then another reply), :func:`rerank_reply`, :func:`computed` (made
from the request when it arrives).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Reply:
    kind: str  # chat | status | delay | drip | rerank | raw | computed
    body: dict = field(default_factory=dict)
    code: int = 200
    headers: dict = field(default_factory=dict)
    seconds: float = 0.0
    then: "Reply | None" = None
    text: str = ""
    fn: "Callable[[Request], Reply] | None" = None
    until: threading.Event | None = None  # delay: wait for this (at most ``seconds``)


def chat(content: str | dict | list | None = "", *, tool_calls: list[dict] | None = None,
         finish_reason: str | None = None, prompt_tokens: int = 100,
         completion_tokens: int = 20) -> Reply:
    """A chat completion. ``content`` that is a dict/list is JSON-encoded. ``tool_calls``:
    ``[{"name": ..., "arguments": {...}}]`` (ids are generated). ``finish_reason`` defaults
    to ``tool_calls`` when there are tool calls, else ``stop``."""
    if isinstance(content, (dict, list)):
        content = json.dumps(content)
    calls = [{"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}}
             for c in (tool_calls or [])]
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return Reply("chat", {
        "message": msg,
        "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}})


def cut(reply: Reply, after_chars: int) -> Reply:
    """``reply`` streamed only up to ``after_chars`` characters of its content, then the
    connection is closed: no finish chunk, no ``[DONE]`` (a provider that died mid-answer)."""
    reply.seconds = -float(after_chars)  # negative: a cut point, not a delay
    return reply


def computed(fn: Callable[["Request"], Reply]) -> Reply:
    """A reply made from the request when it arrives (``fn(request)`` → another reply):
    for answers that must name ids the test cannot know beforehand."""
    return Reply("computed", fn=fn)


def status(code: int, message: str = "stub error", retry_after: float | None = None) -> Reply:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return Reply("status", {"error": {"message": message, "type": "stub", "code": code}},
                 code=code, headers=headers)


def delay(seconds: float, then: Reply | None = None) -> Reply:
    """Sleep ``seconds`` before answering with ``then`` (default: an empty chat reply)."""
    return Reply("delay", seconds=seconds, then=then or chat("{}"))


def gate(event: threading.Event, then: Reply | None = None, most_s: float = 60.0) -> Reply:
    """Hold the request until the test sets ``event`` (at most ``most_s`` seconds, so a
    test never hangs), then answer with ``then`` (default: an empty chat reply): keeps a
    model call in flight for exactly as long as a test needs."""
    return Reply("delay", seconds=most_s, then=then or chat("{}"), until=event)


def drip(every_s: float, until: threading.Event, piece: bytes = b" ") -> Reply:
    """A reply that never ends: a 200 with a long ``Content-Length``, then ``piece`` every
    ``every_s`` seconds until the test sets ``until`` (each byte resets a client's read
    timeout, so only a bound on the whole call ends it)."""
    return Reply("drip", seconds=every_s, until=until, text=piece.decode())


def rerank_reply(scores: list[float]) -> Reply:
    """A rerank answer giving document i the relevance ``scores[i]`` (sorted best first,
    as real servers do)."""
    results = sorted(({"index": i, "relevance_score": s} for i, s in enumerate(scores)),
                     key=lambda r: -r["relevance_score"])
    return Reply("rerank", {"id": uuid.uuid4().hex, "results": results,
                            "usage": {"total_tokens": 10 * len(scores)}})


@dataclass
class Rule:
    route: str
    match: str | None
    replies: list[Reply]
    forever: bool = False  # answer every matching request with the one reply


@dataclass
class Request:
    path: str
    body: dict
    raw: str

    @property
    def messages(self) -> list[dict]:
        return self.body.get("messages", [])

    def text(self) -> str:
        """All message contents joined (what the model was shown)."""
        return "\n".join(str(m.get("content") or "") for m in self.messages)


#: A substring of every opinion-formation request (services/reflect/opinions.py's prompt).
OPINION_FORMATION = "Form opinions from a reflection"

_ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
           "/v1/rerank": "rerank", "/v2/rerank": "rerank", "/rerank": "rerank",
           "/v1/embeddings": "embeddings", "/embeddings": "embeddings"}


class StubLLM:
    """The stub server; use as a context manager or call :meth:`start`/:meth:`stop`.
    ``base_url`` is ``http://127.0.0.1:<port>/v1`` (what an OpenAI-compatible client
    wants); ``root_url`` has no ``/v1``."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self.requests: list[Request] = []
        #: set once a client closed its connection while a reply was being written
        self.client_gone = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- scripting ---------------------------------------------------------------------

    def on(self, route: str, *replies: Reply, match: str | None = None,
           forever: bool = False) -> "StubLLM":
        """Script ``replies`` for ``route`` (chat, rerank, embeddings), used in order by
        requests whose body contains ``match`` (any request when None). ``forever``: one
        reply (typically :func:`computed`) answers every such request, never used up."""
        if forever and len(replies) != 1:
            raise ValueError("forever takes exactly one reply")
        with self._lock:
            self.rules.append(Rule(route, match, list(replies), forever))
        return self

    def chat_requests(self, without: str | None = None) -> list[Request]:
        """The chat requests so far, those whose body holds ``without`` left out (e.g.
        :data:`OPINION_FORMATION`: the opinions a reflection forms are asked for after it
        answered, concurrently with what a test does next)."""
        with self._lock:
            return [r for r in self.requests if _ROUTES.get(r.path) == "chat"
                    and (without is None or without not in r.raw)]

    def _next(self, route: str, raw: str) -> Reply | None:
        with self._lock:
            for rule in self.rules:
                if rule.route == route and rule.replies and (rule.match is None or rule.match in raw):
                    return rule.replies[0] if rule.forever else rule.replies.pop(0)
        return None

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> "StubLLM":
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "stub-model"}]})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n).decode() if n else ""
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    body = {}
                with stub._lock:
                    stub.requests.append(Request(self.path, body, raw))
                route = _ROUTES.get(self.path.split("?")[0])
                reply = stub._next(route, raw) if route else None
                if reply is not None and reply.kind == "computed":
                    reply = reply.fn(Request(self.path, body, raw))
                try:
                    self._answer(route, body, reply)
                except (BrokenPipeError, ConnectionResetError):
                    stub.client_gone.set()  # the client gave up (timeout test)

            def _answer(self, route, body, reply: Reply | None):
                while reply is not None and reply.kind == "delay":
                    if reply.until is not None:
                        reply.until.wait(reply.seconds)
                    else:
                        time.sleep(reply.seconds)
                    reply = reply.then
                if reply is None:
                    if route == "embeddings":
                        inputs = body.get("input") or []
                        inputs = [inputs] if isinstance(inputs, str) else inputs
                        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]}
                                for i in range(len(inputs))]
                        self._send(200, {"object": "list", "data": data, "model": body.get("model"),
                                         "usage": {"prompt_tokens": 1, "total_tokens": 1}})
                        return
                    self._send(500, {"error": {"message": "unscripted", "type": "stub"}})
                    return
                if reply.kind == "drip":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                    while not reply.until.wait(reply.seconds):
                        self.wfile.write(reply.text.encode())
                        self.wfile.flush()
                    self.close_connection = True
                elif reply.kind == "status":
                    self._send(reply.code, reply.body, reply.headers)
                elif reply.kind == "raw":
                    self._send_text(reply.code, reply.text)
                elif reply.kind == "rerank":
                    self._send(200, reply.body)
                elif body.get("stream"):
                    self._stream(body, reply)
                else:
                    self._send(200, {
                        "id": f"chatcmpl-{uuid.uuid4().hex[:10]}", "object": "chat.completion",
                        "created": int(time.time()), "model": body.get("model", "stub-model"),
                        "choices": [{"index": 0, "message": reply.body["message"],
                                     "finish_reason": reply.body["finish_reason"]}],
                        "usage": reply.body["usage"]})

            def _stream(self, body, reply: Reply):
                """SSE chunks: content in pieces of 5 characters, tool calls in one chunk,
                then the finish chunk and (if asked) a usage chunk."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                base = {"id": f"chatcmpl-{uuid.uuid4().hex[:10]}", "object": "chat.completion.chunk",
                        "created": int(time.time()), "model": body.get("model", "stub-model")}

                def emit(delta, finish=None, usage=None):
                    chunk = dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": finish}])
                    if usage is not None:
                        chunk = dict(base, choices=[], usage=usage)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()

                msg = reply.body["message"]
                emit({"role": "assistant", "content": ""})
                content = msg.get("content") or ""
                if reply.seconds < 0:  # cut(): the answer stops here, the connection closes
                    for i in range(0, int(-reply.seconds), 5):
                        emit({"content": content[i:min(i + 5, int(-reply.seconds))]})
                    self.close_connection = True
                    return
                for i in range(0, len(content), 5):
                    emit({"content": content[i:i + 5]})
                for k, tc in enumerate(msg.get("tool_calls") or []):
                    emit({"tool_calls": [dict(tc, index=k)]})
                emit({}, finish=reply.body["finish_reason"])
                if (body.get("stream_options") or {}).get("include_usage"):
                    emit({}, usage=reply.body["usage"])
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _send(self, code, obj, headers=None):
                self._send_text(code, json.dumps(obj), headers, "application/json")

            def _send_text(self, code, text, headers=None, ctype="text/plain"):
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # shutdown() waits for the loop's next poll: at the default 0.5 s that was most
        # of the teardown of every test with a stub
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                         name="stub-llm", daemon=True).start()
        return self

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StubLLM":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
