"""The fuzz suite's harness: one real ``mneme up`` for the module, a checked call per
request, the write property, an RSS watchdog, and a summary at the end of the run.

Every generated request goes through :meth:`Harness.run`, which never raises for server
behaviour: it records each *class* of failure (keyed by RPC, kind and a normalised
message) with its smallest request, so one bounded run reports every class it finds;
each test then fails if its cases recorded any (see :meth:`Harness.assert_clean`).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from google.protobuf import text_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from mneme.v1 import (banks_pb2, banks_pb2_grpc, directives_pb2_grpc, documents_pb2_grpc,
                      entities_pb2_grpc, generations_pb2_grpc, keys_pb2_grpc,
                      mental_models_pb2_grpc,
                      memory_pb2, memory_pb2_grpc,
                      observations_pb2_grpc, opinions_pb2_grpc, operations_pb2, operations_pb2_grpc, recall_pb2,
                      recall_pb2_grpc, reflect_pb2_grpc, resources_pb2)
from tests.e2e.server import Server

#: A deadline at least this long is "generous": DEADLINE_EXCEEDED under it is a server bug.
#: (A sync retain also waits for the bank's earlier work: on a 2-core machine running two
#: other test suites at the same time, one small retain took over 30 s.)
GENEROUS_S = 60.0
#: The server's RSS (summed over its process tree) must stay under this.
RSS_BOUND = int(os.environ.get("MNEME_FUZZ_RSS_BOUND", 2 << 30))
#: Requests bigger than this count as huge; each test sends at most HUGE_CAP of them
#: (beyond that a case's long strings are cut to 1 KiB).
HUGE_BYTES = 256 << 10
HUGE_CAP = 4
#: Fresh servers started after the first one died or was killed, at most.
MAX_RESTARTS = 3
#: Fixed banks created at start; most generated requests address them.
FIXED_BANKS = ("fuzz-a", "fuzz-b")
#: Document ids the seed retains use; generated retains and deletes draw from them too.
DOC_IDS = ("doc-0", "doc-1", "doc-2", "doc-3")

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE}
#: How an invalid request may be refused (limits may answer RESOURCE_EXHAUSTED).
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
TERMINAL = {operations_pb2.SUCCEEDED, operations_pb2.FAILED}

# rpc → (stub class, streaming): every RPC of mneme.v1 but those in UNFUZZED
# (test_every_rpc_is_fuzzed)
RPCS = {
    "UpsertBank": (banks_pb2_grpc.BankServiceStub, False),
    "UpdateBank": (banks_pb2_grpc.BankServiceStub, False),
    "GetBank": (banks_pb2_grpc.BankServiceStub, False),
    "ListBanks": (banks_pb2_grpc.BankServiceStub, False),
    "DeleteBank": (banks_pb2_grpc.BankServiceStub, False),
    "GetBankStats": (banks_pb2_grpc.BankServiceStub, False),
    "GetBankProfile": (banks_pb2_grpc.BankServiceStub, False),
    "CheckLlm": (banks_pb2_grpc.BankServiceStub, False),
    "Consolidate": (memory_pb2_grpc.MemoryServiceStub, False),
    "ClearObservations": (memory_pb2_grpc.MemoryServiceStub, False),
    "GetGeneration": (generations_pb2_grpc.GenerationServiceStub, False),
    "ListGenerations": (generations_pb2_grpc.GenerationServiceStub, False),
    "DeleteGeneration": (generations_pb2_grpc.GenerationServiceStub, False),
    "BatchGetDataKeys": (keys_pb2_grpc.KeyServiceStub, False),
    "Retain": (memory_pb2_grpc.MemoryServiceStub, False),
    "DeleteDocument": (memory_pb2_grpc.MemoryServiceStub, False),
    "DeleteMemory": (memory_pb2_grpc.MemoryServiceStub, False),
    "DeleteOpinion": (memory_pb2_grpc.MemoryServiceStub, False),
    "ListOpinions": (opinions_pb2_grpc.OpinionServiceStub, False),
    "GetOpinion": (opinions_pb2_grpc.OpinionServiceStub, False),
    "Recall": (recall_pb2_grpc.RecallServiceStub, False),
    "GetMemory": (recall_pb2_grpc.RecallServiceStub, False),
    "ListMemories": (recall_pb2_grpc.RecallServiceStub, False),
    "Reflect": (reflect_pb2_grpc.ReflectServiceStub, False),
    "StreamReflect": (reflect_pb2_grpc.ReflectServiceStub, True),
    "GetOperation": (operations_pb2_grpc.OperationServiceStub, False),
    "ListOperations": (operations_pb2_grpc.OperationServiceStub, False),
    "CancelOperation": (operations_pb2_grpc.OperationServiceStub, False),
    "RetryOperation": (operations_pb2_grpc.OperationServiceStub, False),
    "ListObservations": (observations_pb2_grpc.ObservationServiceStub, False),
    "ListObservationScopes": (observations_pb2_grpc.ObservationServiceStub, False),
    "GetObservation": (observations_pb2_grpc.ObservationServiceStub, False),
    "ListEntities": (entities_pb2_grpc.EntityServiceStub, False),
    "GetEntity": (entities_pb2_grpc.EntityServiceStub, False),
    "MergeEntities": (entities_pb2_grpc.EntityServiceStub, False),
    "SplitEntity": (entities_pb2_grpc.EntityServiceStub, False),
    "ListDocuments": (documents_pb2_grpc.DocumentServiceStub, False),
    "GetDocument": (documents_pb2_grpc.DocumentServiceStub, False),
    "ListTags": (documents_pb2_grpc.DocumentServiceStub, False),
    "CreateDirective": (directives_pb2_grpc.DirectiveServiceStub, False),
    "GetDirective": (directives_pb2_grpc.DirectiveServiceStub, False),
    "ListDirectives": (directives_pb2_grpc.DirectiveServiceStub, False),
    "UpdateDirective": (directives_pb2_grpc.DirectiveServiceStub, False),
    "DeleteDirective": (directives_pb2_grpc.DirectiveServiceStub, False),
    "CreateMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "GetMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "ListMentalModels": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "UpdateMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "DeleteMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "ClearMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "ListMentalModelRevisions": (mental_models_pb2_grpc.MentalModelServiceStub, False),
    "RefreshMentalModel": (mental_models_pb2_grpc.MentalModelServiceStub, False),
}

#: RPCs the fuzzer does not send, and why.
UNFUZZED = {"CreateGeneration": "each accepted call starts a replay of every store"}

REPORTS: list[str] = []  # printed by pytest_terminal_summary


@dataclass(frozen=True)
class Ref:
    """A value only known at send time: ``kind`` memory | observation | operation | token,
    the ``index``-th one seen (modulo how many), formatted into ``template`` and set on
    the request's top-level ``field``."""
    field: str
    kind: str
    index: int
    template: str = "{}"


@dataclass
class Case:
    """One generated request and what the server must do with it.

    ``bank``: the bank id it addresses when that id is well formed (NOT_FOUND is fine for
    a bank that does not exist); ``write``: an accepted request must leave ``bank``
    readable; ``must_refuse``: why the request is invalid (INVALID_ARGUMENT required);
    ``item_refusals``: Retain items that are invalid (INVALID_ARGUMENT for the request, or
    an item error naming the item); ``partial``: a Retain mixing valid and invalid items,
    which must be accepted with item errors for exactly the invalid ones; ``keep``:
    UpdateBank fields outside the update_mask, which must keep their values; ``refs``:
    values filled in at send time."""
    rpc: str
    req: Message
    timeout: float = GENEROUS_S
    bank: str | None = None
    write: bool = False
    must_refuse: str = ""
    item_refusals: dict[int, str] = field(default_factory=dict)
    refs: tuple[Ref, ...] = ()
    partial: bool = False
    keep: tuple[str, ...] = ()

    def __repr__(self) -> str:  # hypothesis prints cases on errors of the harness itself
        return f"Case({self.rpc}, timeout={self.timeout}, {abbrev(self.req)[:300]!r})"


@dataclass
class Failure:
    key: tuple[str, str, str]
    rpc: str
    message: str
    request: str
    size: int
    timeout: float
    log: str
    test: str
    count: int = 1

    def render(self) -> str:
        out = [f"[{self.count}x] {self.rpc} ({self.key[1]}): {self.key[2]}  (test {self.test})"]
        if self.message != self.key[2]:
            out.append(f"  smallest: {self.message}")
        out.append(f"  request (text format), deadline {self.timeout:g}s:")
        out += ["    " + line for line in self.request.splitlines()]
        if self.log:
            out += ["  server log:"] + ["    " + line for line in self.log.splitlines()]
        return "\n".join(out)


def abbrev(msg: Message, limit: int = 300) -> str:
    """``msg`` in protobuf text format with long strings and lists shortened (noted
    inline), so a repro of a multi-megabyte request stays readable."""
    notes: list[str] = []
    short = type(msg)()
    short.CopyFrom(msg)
    _shorten(short, "", limit, notes)
    text = text_format.MessageToString(short, as_utf8=True)
    return "".join(f"# {n}\n" for n in notes) + text


def _shorten(msg: Message, path: str, limit: int, notes: list[str]) -> None:
    for fd, value in list(msg.ListFields()):
        p = f"{path}{fd.name}"
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if len(value) > 6:
                keys = list(value.keys())
                notes.append(f"{p}: {len(keys)} entries, first 6 kept")
                for k in keys[6:]:
                    del value[k]
            for k in list(value.keys()):
                v = value[k]
                if isinstance(v, str) and len(v) > limit:
                    notes.append(f"{p}[{k[:20]!r}]: {len(v)} chars, shortened")
                    value[k] = v[:60]
        elif fd.is_repeated:
            if len(value) > 6:
                notes.append(f"{p}: {len(value)} elements, first 6 kept")
                del value[6:]
            for i, v in enumerate(value):
                if isinstance(v, Message):
                    _shorten(v, f"{p}[{i}].", limit, notes)
                elif isinstance(v, str) and len(v) > limit:
                    notes.append(f"{p}[{i}]: {len(v)} chars, shortened")
                    value[i] = v[:60]
        elif isinstance(value, Message):
            _shorten(value, f"{p}.", limit, notes)
        elif isinstance(value, str) and len(value) > limit:
            notes.append(f"{p}: {len(value)} chars ({value[:20]!r}...), shortened")
            setattr(msg, fd.name, value[:60])


def _cut_strings(msg: Message, keep: int) -> None:
    """Cut every string of ``msg`` (nested, repeated, map values) to ``keep`` characters."""
    for fd, value in list(msg.ListFields()):
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            for k in list(value.keys()):
                if isinstance(value[k], str):
                    value[k] = value[k][:keep]
                elif isinstance(value[k], Message):
                    _cut_strings(value[k], keep)
        elif fd.is_repeated:
            for i, v in enumerate(value):
                if isinstance(v, Message):
                    _cut_strings(v, keep)
                elif isinstance(v, str):
                    value[i] = v[:keep]
        elif isinstance(value, Message):
            _cut_strings(value, keep)
        elif isinstance(value, str):
            setattr(msg, fd.name, value[:keep])


def _leaf(msg: Message, path: str):
    """The value at a dotted field path; an unset optional field is None."""
    *parents, name = path.split(".")
    for p in parents:
        msg = getattr(msg, p)
    fd = msg.DESCRIPTOR.fields_by_name[name]
    if fd.has_presence and not fd.message_type and not msg.HasField(name):
        return None
    return getattr(msg, name)


def _token_key(case: "Case") -> str:
    """Page tokens are kept per list (RPC and parent): tokens are bound to their list."""
    return f"token:{case.rpc}:{getattr(case.req, 'parent', '')}"


def _category(why: str) -> str:
    """The field part of a refusal reason: "bank id: trailing newline" → "bank id"."""
    return why.split(";")[0].split(":")[0]


def _norm(s: str) -> str:
    """A status message with quoted values, ids and numbers blanked, for grouping."""
    s = s.splitlines()[0] if s else ""
    s = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", s)
    s = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<id>", s)
    s = re.sub(r"-?\d+", "N", s)
    return s[:120]


def _log_excerpt(text: str, max_lines: int = 24) -> str:
    """Warnings, errors and tracebacks of a server log segment, each traceback cut to its
    last frames and exception (at most ``max_lines`` lines)."""
    keep: list[str] = []
    tb: list[str] = []
    for line in text.splitlines():
        if line.startswith("Traceback"):
            tb = [line]
        elif tb and line.startswith(" "):
            if not line.strip().startswith(("^", "~")):
                tb.append(line)
        elif tb:  # the exception line ends the traceback
            keep += [tb[0], "  ...", *tb[-4:], line]
            tb = []
        elif re.search(r"WARNING|ERROR|CRITICAL|Exception|dead-letter", line):
            keep.append(line)
    return "\n".join(line[:300] for line in keep[-max_lines:])


class Watchdog(threading.Thread):
    """Samples the RSS of the server's process tree every 0.2 s; over RSS_BOUND it
    SIGKILLs that tree (a runaway must not take the shared machine down) and says so."""

    def __init__(self, harness: "Harness"):
        super().__init__(daemon=True)
        self.h = harness
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            rss = self.h.rss()
            if rss > RSS_BOUND:
                self.h.killed_for_rss = rss
                self.h.kill_tree()


class Harness:
    """The server under test, its client stubs, and what the run has seen.

    ``stats[rpc]`` counts status codes per RPC (the property checks and operation polls
    count under ``Recall(property)``, ``ListMemories(property)``, ``GetOperation(poll)``);
    ``failures`` maps a failure class to its :class:`Failure` with the smallest request."""

    def __init__(self, root: Path):
        self.root = root
        self.generation = 0
        self.server: Server | None = None
        self.channel: grpc.Channel | None = None
        self.stubs: dict = {}
        self.stats: dict[str, Counter] = defaultdict(Counter)
        self.refused: dict[str, Counter] = defaultdict(Counter)  # rpc → first violation field
        self.failures: dict[tuple, Failure] = {}
        self.order: list[tuple] = []
        self.banks: set[str] = set()
        self.seen: dict[str, list[str]] = defaultdict(list)  # ref kind → values seen
        self.peak_rss = 0
        self.killed_for_rss = 0
        self.huge_sent: Counter = Counter()  # per test
        self.recorded_case = False
        self.dead = False
        self.stop_s = 0.0
        self.skipped: Counter = Counter()
        self.test = ""
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.start()
        self.watchdog = Watchdog(self)
        self.watchdog.start()

    # ---- server lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """A fresh ``mneme up`` on a new data dir, with the fixed banks and seed memories."""
        self.generation += 1
        data = self.root / f"data{self.generation}"
        self.server = Server(data).start()
        self.channel = grpc.insecure_channel(self.server.address, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        self.stubs = {cls: cls(self.channel) for cls, _ in RPCS.values()}
        self.banks = set()
        self.seen = defaultdict(list)
        try:
            for b in FIXED_BANKS:
                self.make_fixed_bank(b)
        except grpc.RpcError as e:  # leave no server behind
            log = self.server.log
            self.kill_tree()
            self.stop_server()
            raise RuntimeError(f"fixed banks not created ({e.code().name}: {e.details()}); "
                               f"server log:\n{log.read_text(errors='replace')[-3000:]}") from None

    def make_fixed_bank(self, bank_id: str) -> None:
        stub = self.stubs[banks_pb2_grpc.BankServiceStub]
        stub.UpsertBank(banks_pb2.UpsertBankRequest(bank=resources_pb2.Bank(
            name=f"banks/{bank_id}", display_name=bank_id)), timeout=GENEROUS_S)
        self.banks.add(bank_id)
        items = [memory_pb2.RetainItem(content=c, document_id=DOC_IDS[i % len(DOC_IDS)],
                                       tags=["seed", f"t{i % 2}"])
                 for i, c in enumerate(SEED_TEXTS)]
        r = self.stubs[memory_pb2_grpc.MemoryServiceStub].Retain(
            memory_pb2.RetainRequest(parent=f"banks/{bank_id}", items=items), timeout=120)
        self.seen[f"memory:{bank_id}"] += list(r.memory_ids)
        self.seen["operation"].append(r.operation.name)

    def tree(self) -> list[psutil.Process]:
        if not self.server or not self.server.proc:
            return []
        try:
            p = psutil.Process(self.server.proc.pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        with self.lock:
            self.peak_rss = max(self.peak_rss, total)
        return total

    def kill_tree(self) -> None:
        """SIGKILL the server and its children (processes this harness started)."""
        for p in reversed(self.tree()):
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def alive(self) -> bool:
        return bool(self.server and self.server.proc and self.server.proc.poll() is None)

    def close(self) -> None:
        self.watchdog.stop.set()
        self.watchdog.join(5)
        self.stop_server()

    def stop_server(self) -> None:
        if self.channel:
            self.channel.close()
        if self.server:
            children = self.tree()[1:]
            t0 = time.monotonic()
            self.server.stop(timeout=30)
            self.stop_s = time.monotonic() - t0
            for p in children:  # a child left behind is the server's bug, not ours to keep
                try:
                    if p.is_running():
                        os.kill(p.pid, signal.SIGKILL)
                except (psutil.Error, ProcessLookupError):
                    pass
        self.server = None

    def restart_after_death(self, case: Case, log_from: int) -> None:
        """Record why the server is gone (RSS kill or death) and start a fresh one, at
        most MAX_RESTARTS times; after that the remaining cases are not sent."""
        rss, self.killed_for_rss = self.killed_for_rss, 0
        if rss:
            msg = f"server RSS {rss >> 20} MiB over the {RSS_BOUND >> 20} MiB bound (killed)"
            group, kind = f"server RSS over the {RSS_BOUND >> 20} MiB bound (killed)", "rss"
        else:
            rc = self.server.proc.poll() if self.server and self.server.proc else None
            msg, kind = f"server process died (exit {rc})", "died"
            group = msg
        self.record(case, kind, msg, log_from, group=group)
        self.kill_tree()
        self.stop_server()
        if self.generation > MAX_RESTARTS:
            self.dead = True
            return
        try:
            self.start()
        except RuntimeError:
            self.dead = True

    # ---- calls ------------------------------------------------------------------------
    def _log_offset(self) -> int:
        try:
            return self.server.log.stat().st_size
        except (OSError, AttributeError):
            return 0

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.server.log, "rb") as f:
                f.seek(offset)
                return _log_excerpt(f.read(4 << 20).decode("utf-8", "replace"))
        except (OSError, AttributeError):
            return ""

    def call(self, rpc: str, req: Message, timeout: float, label: str | None = None):
        """Send one request; returns (status code, response or None, error or None)."""
        cls, streaming = RPCS[rpc]
        method = getattr(self.stubs[cls], rpc)
        try:
            if streaming:
                resp = list(method(req, timeout=timeout))
            else:
                resp = method(req, timeout=timeout)
            code, err = grpc.StatusCode.OK, None
        except grpc.RpcError as e:
            code, resp, err = e.code(), None, e
        self.stats[label or rpc][code.name] += 1
        return code, resp, err

    def fill(self, case: Case) -> None:
        for ref in case.refs:
            key = {"operation": "operation", "token": _token_key(case)}.get(
                ref.kind, f"{ref.kind}:{case.bank}")
            pool = self.seen.get(key, [])
            if pool:
                value = pool[ref.index % len(pool)]
            else:  # nothing seen yet: a well-formed id that names nothing
                value = "" if ref.kind == "token" else str(uuid.UUID(int=ref.index + 1))
            if ref.kind == "operation":
                value = value.split("/", 1)[-1]
            *path, last = ref.field.split(".")  # a nested field: "directive.name"
            target = case.req
            for part in path:
                target = getattr(target, part)
            if last.endswith("[]"):  # one more element of a repeated field
                getattr(target, last[:-2]).append(ref.template.format(value))
            else:
                setattr(target, last, ref.template.format(value))

    def run(self, case: Case, budget_end: float) -> None:
        """Send ``case`` with every check; records failures, never raises for them."""
        if time.monotonic() > budget_end:
            self.skipped[self.test] += 1
            return
        if self.dead:
            self.skipped["server gone (restarts exhausted)"] += 1
            self.record(case, "died", "no server: restarts exhausted, case not sent", 0)
            return
        self.fill(case)
        self.recorded_case = False
        if case.req.ByteSize() > HUGE_BYTES:
            if self.huge_sent[self.test] >= HUGE_CAP:
                _cut_strings(case.req, 1024)  # bounded run: the case goes on, not huge
                self.skipped["huge values cut (cap reached)"] += 1
            else:
                self.huge_sent[self.test] += 1
        if not self.alive():
            self.restart_after_death(case, 0)
            if self.dead:
                return
        log_from = self._log_offset()
        before = self.get_bank(case.bank) if case.keep and case.bank in self.banks else None
        code, resp, err = self.call(case.rpc, case.req, case.timeout)
        if not self.alive() or self.killed_for_rss:
            self.restart_after_death(case, log_from)
            return
        self.check_status(case, code, resp, err, log_from)
        if code == grpc.StatusCode.OK:
            self.remember(case, resp)
        if before is not None and code == grpc.StatusCode.OK:
            self.check_kept(case, before, resp, log_from)
        if case.rpc == "UpsertBank" and code == grpc.StatusCode.OK and case.bank:
            self.banks.add(case.bank)
        if case.write and case.bank in self.banks and code in (
                grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
            op = self.check_operation(case, resp, log_from) if resp is not None else None
            if op is not None and case.item_refusals:
                self.check_item_errors(case, op, log_from)
            self.check_readable(case, log_from)
        rss = self.rss()
        if rss > RSS_BOUND:
            self.record(case, "rss", f"server RSS {rss / 2**30:.2f} GiB after the call", log_from)
        if not self.recorded_case:
            self.check_log(case, log_from)

    def check_log(self, case: Case, log_from: int) -> None:
        """No ERROR, traceback or dead-letter in the server log while a case ran (its
        status was fine: a background failure, e.g. a projection that dead-lettered)."""
        try:
            with open(self.server.log, "rb") as f:
                f.seek(log_from)
                text = f.read(4 << 20).decode("utf-8", "replace")
        except OSError:
            return
        for line in text.splitlines():
            if re.search(r" (ERROR|CRITICAL) |dead-letter|^Traceback", line):
                msg = re.sub(r"^[\d-]+ [\d:,]+ ", "", line)
                self.record(case, "server-log", f"logged: {msg[:200]}", log_from,
                            group=f"logged: {_norm(msg)}")
                return

    def check_status(self, case: Case, code, resp, err, log_from: int) -> None:
        details = err.details() if err is not None else ""
        generous = case.timeout >= GENEROUS_S
        if code not in ALLOWED and not (code == grpc.StatusCode.DEADLINE_EXCEEDED and not generous):
            self.record(case, "status", f"{code.name}: {_norm(details or '')}", log_from)
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            self.check_bad_request(case, err, log_from)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return  # a short deadline passed: nothing else is promised
        bank_missing = case.bank is not None and case.bank not in self.banks
        if case.partial and code != grpc.StatusCode.OK:
            self.record(case, "per-item", f"retain of {len(case.req.items)} items, "
                        f"{len(case.item_refusals)} invalid: answered {code.name}, not OK with "
                        "item errors", log_from,
                        group=f"valid and invalid items in one retain: answered {code.name}")
        if case.must_refuse and code not in REFUSED and not (
                bank_missing and code == grpc.StatusCode.NOT_FOUND):
            self.record(case, "accepted-invalid",
                        f"{case.must_refuse}: answered {code.name}, not INVALID_ARGUMENT", log_from,
                        group=f"{_category(case.must_refuse)} malformed: answered {code.name}")

    def get_bank(self, bank_id: str):
        code, bank, _ = self.call("GetBank", banks_pb2.GetBankRequest(name=f"banks/{bank_id}"),
                                  GENEROUS_S, "GetBank(property)")
        return bank if code == grpc.StatusCode.OK else None

    def check_kept(self, case: Case, before, after, log_from: int) -> None:
        """UpdateBank (AIP-134): fields outside the update_mask keep their values, in the
        answer and in a GetBank after it."""
        stored = self.get_bank(case.bank)
        for leaf in case.keep:
            old = _leaf(before, leaf)
            for label, bank in (("answer", after), ("GetBank", stored)):
                if bank is not None and _leaf(bank, leaf) != old:
                    self.record(case, "update-mask", f"{leaf} changed from {old!r:.60} to "
                                f"{_leaf(bank, leaf)!r:.60} ({label}) though not in update_mask",
                                log_from, group=f"a field outside update_mask changed ({leaf})")
                    return

    def check_item_errors(self, case: Case, op, log_from: int) -> None:
        """An accepted retain names each invalid item in its operation's item errors."""
        named = {e.item_index for e in op.item_errors}
        missing = sorted(set(case.item_refusals) - named)
        if missing:
            why = case.item_refusals[missing[0]]
            self.record(case, "accepted-invalid", f"items[{missing[0]}].{why}: retain accepted "
                        "without an item error for it", log_from,
                        group=f"items[].{_category(why)} invalid: accepted without an item error")
        if case.partial:
            wrong = sorted(named - set(case.item_refusals))
            if wrong:
                self.record(case, "per-item", f"valid items {wrong} failed with the invalid ones",
                            log_from, group="valid items of a mixed retain failed")

    def check_bad_request(self, case: Case, err, log_from: int) -> None:
        status = rpc_status.from_call(err)
        violations = []
        for d in status.details if status else []:
            br = error_details_pb2.BadRequest()
            if d.Unpack(br):
                violations += list(br.field_violations)
        fields = case.req.DESCRIPTOR.fields_by_name
        for v in violations[:1]:
            self.refused[case.rpc][re.sub(r"\[\d+\]", "[]", v.field)] += 1
        if not violations:
            self.record(case, "bad-request", "INVALID_ARGUMENT without BadRequest field "
                        f"violations: {_norm(err.details() or '')}", log_from)
        elif not any(re.split(r"[.\[]", v.field)[0] in fields for v in violations):
            self.record(case, "bad-request", "INVALID_ARGUMENT whose violations name no field "
                        f"of {case.req.DESCRIPTOR.name}: "
                        f"{[_norm(v.field) for v in violations][:3]}", log_from)

    def remember(self, case: Case, resp) -> None:
        """Keep ids and page tokens the server returned, for later Refs."""
        if case.rpc == "Retain":
            self.seen[f"memory:{case.bank}"] += list(resp.memory_ids)
            self.seen["operation"].append(resp.operation.name)
        elif case.rpc in ("DeleteDocument", "DeleteMemory", "DeleteOpinion", "RetryOperation"):
            self.seen["operation"].append(resp.name)
        token = getattr(resp, "next_page_token", "")
        if token:
            self.seen[_token_key(case)].append(token)
        if case.rpc == "ListMemories":
            self.seen[f"memory:{case.bank}"] += [m.id for m in resp.memories]
        if case.rpc == "ListObservations":
            self.seen[f"observation:{case.bank}"] += [o.id for o in resp.observations]
        if case.rpc == "ListOpinions":
            self.seen[f"opinion:{case.bank}"] += [o.id for o in resp.opinions]
        if case.rpc == "ListEntities":
            self.seen[f"entity:{case.bank}"] += [e.id for e in resp.entities]
        if case.rpc == "CreateMentalModel":
            self.seen[f"mental_model:{case.bank}"].append(resp.id)
        if case.rpc == "ListMentalModels":
            self.seen[f"mental_model:{case.bank}"] += [x.id for x in resp.mental_models]
        if case.rpc == "CreateDirective":
            self.seen[f"directive:{case.bank}"].append(resp.id)
        if case.rpc == "ListDirectives":
            self.seen[f"directive:{case.bank}"] += [d.id for d in resp.directives]
        for k in list(self.seen):
            del self.seen[k][:-200]  # keep the pools small

    def check_operation(self, case: Case, resp, log_from: int):
        """A write's operation must end (SUCCEEDED or FAILED) within GENEROUS_S; returns
        it as it ended (None when the response carries no operation or it did not end)."""
        op = resp.operation if case.rpc == "Retain" else resp
        if not isinstance(op, operations_pb2.Operation) or not op.name:
            return None
        end = time.monotonic() + GENEROUS_S
        while op.state not in TERMINAL:
            if time.monotonic() > end:
                self.record(case, "op", "operation still "
                            f"{operations_pb2.OperationState.Name(op.state)} {GENEROUS_S:g}s "
                            "after the write", log_from)
                return None
            time.sleep(0.05)  # most end within tens of ms: a longer first wait was most of it
            code, got, _ = self.call("GetOperation", operations_pb2.GetOperationRequest(
                name=op.name), GENEROUS_S, "GetOperation(poll)")
            if code != grpc.StatusCode.OK:
                self.record(case, "op", f"GetOperation of its operation: {code.name}", log_from)
                return None
            op = got
        return op

    def check_readable(self, case: Case, log_from: int) -> None:
        """THE PROPERTY: after an accepted write the bank answers Recall and ListMemories."""
        parent = f"banks/{case.bank}"
        checks = [("Recall", recall_pb2.RecallRequest(parent=parent, query="what happened?")),
                  ("ListMemories", memory_pb2.ListMemoriesRequest(parent=parent))]
        broken = []
        for rpc, req in checks:
            code, resp, err = self.call(rpc, req, GENEROUS_S, f"{rpc}(property)")
            if code != grpc.StatusCode.OK:
                broken.append(f"{rpc} {code.name}: {_norm(err.details() or '')}")
            else:
                self.remember(Case(rpc, req, bank=case.bank), resp)
        if broken:
            self.record(case, "property", "bank unreadable after an accepted write: "
                        + "; ".join(broken), log_from)
            if case.bank in FIXED_BANKS:
                self.reset_bank(case.bank)

    def reset_bank(self, bank_id: str) -> None:
        """Delete and recreate a fixed bank a write made unreadable, so later cases test
        something else than the same broken bank."""
        try:
            self.stubs[banks_pb2_grpc.BankServiceStub].DeleteBank(
                banks_pb2.DeleteBankRequest(name=f"banks/{bank_id}"), timeout=GENEROUS_S)
            self.seen.pop(f"memory:{bank_id}", None)
            self.make_fixed_bank(bank_id)
        except grpc.RpcError as e:
            self.skipped[f"reset of {bank_id} failed: {e.code().name}"] += 1

    def record(self, case: Case, kind: str, message: str, log_from: int,
               group: str | None = None) -> None:
        """Count a failure of ``kind`` under its class (``group``, default ``message``),
        keeping the smallest request of the class as its reproduction."""
        self.recorded_case = True
        key = (case.rpc, kind, group or message)
        size = case.req.ByteSize()
        f = self.failures.get(key)
        if f is None:
            self.order.append(key)
        if f is None or size < f.size:
            f2 = Failure(key, case.rpc, message, abbrev(case.req), size, case.timeout,
                         self._log_since(log_from), self.test, (f.count if f else 0) + 1)
            self.failures[key] = f2
        else:
            f.count += 1

    # ---- restart ----------------------------------------------------------------------
    def all_memory_ids(self, bank_id: str, case: Case) -> set[str] | None:
        """Every memory id of the bank through ListMemories pages (None when a page
        failed, recorded); a token the server just issued must be accepted."""
        ids, token = set(), ""
        for _ in range(100):
            req = memory_pb2.ListMemoriesRequest(parent=f"banks/{bank_id}", page_size=500,
                                                 page_token=token)
            code, resp, err = self.call("ListMemories", req, GENEROUS_S, "ListMemories(restart)")
            if code != grpc.StatusCode.OK:
                self.record(case, "restart", f"ListMemories page {'2+' if token else 1}: "
                            f"{code.name}: {_norm(err.details() or '')}", self._log_offset())
                return None
            ids |= {m.id for m in resp.memories}
            token = resp.next_page_token
            if not token:
                return ids
        return ids

    def quiet(self, timeout: float = 60.0) -> list[str]:
        """Wait until no bank has a pending operation; the banks still pending."""
        end = time.monotonic() + timeout
        pending = sorted(self.banks)
        while pending and time.monotonic() < end:
            still = []
            for b in pending:
                code, st, _ = self.call("GetBankStats", banks_pb2.GetBankStatsRequest(
                    name=f"banks/{b}"), GENEROUS_S, "GetBankStats(restart)")
                if code == grpc.StatusCode.OK and st.pending_operations > 0:
                    still.append(b)
            pending = still
            if pending:
                time.sleep(0.5)
        return pending

    def check_restart(self) -> None:
        """SIGTERM and restart on the same data dir: every bank keeps its memories and
        answers Recall."""
        if self.dead or not self.alive():
            return
        case = Case("Restart", memory_pb2.ListMemoriesRequest())
        log_from = self._log_offset()
        pending = self.quiet()
        if pending:
            self.record(case, "op", f"operations still pending 60s after the last request "
                        f"in banks {pending[:5]}", log_from,
                        group="operations still pending at the end")
        before = {b: self.all_memory_ids(b, Case("ListMemories", case.req, bank=b))
                  for b in sorted(self.banks)}
        srv = self.server
        self.channel.close()
        t0 = time.monotonic()
        srv.stop(timeout=30)
        self.stop_s = time.monotonic() - t0
        srv.start()
        self.channel = grpc.insecure_channel(srv.address, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])
        self.stubs = {cls: cls(self.channel) for cls, _ in RPCS.values()}
        for b, ids in before.items():
            c = Case("ListMemories", memory_pb2.ListMemoriesRequest(parent=f"banks/{b}"), bank=b)
            code, _, err = self.call("GetBank", banks_pb2.GetBankRequest(name=f"banks/{b}"),
                                     GENEROUS_S, "GetBank(restart)")
            if code != grpc.StatusCode.OK:
                self.record(c, "restart", f"GetBank after restart: {code.name}", 0)
                continue
            after = self.all_memory_ids(b, c)
            if ids is not None and after is not None and after != ids:
                self.record(c, "restart", f"memories changed across a restart: {len(ids)} "
                            f"before, {len(after)} after ({len(ids - after)} lost)", 0,
                            group="memories changed across a restart")
            code, _, err = self.call("Recall", recall_pb2.RecallRequest(
                parent=f"banks/{b}", query="what happened?"), GENEROUS_S, "Recall(restart)")
            if code != grpc.StatusCode.OK:
                self.record(c, "restart", f"Recall after restart: {code.name}: "
                            f"{_norm(err.details() or '')}", 0)

    # ---- per test ---------------------------------------------------------------------
    def begin(self, test: str) -> set:
        self.test = test
        return set(self.failures)

    def assert_clean(self, before: set) -> None:
        new = [self.failures[k] for k in self.order if k not in before]
        if self.skipped.get(self.test):
            # The budget bounds the test's time on a slow or busy machine; how fast the
            # server answers is the benchmarks' business, so the cases not sent are a
            # warning (and a line of the report), not a failure.
            warnings.warn(f"time budget of {self.test} exhausted: "
                          f"{self.skipped[self.test]} cases not sent", stacklevel=2)
        assert not new, f"{len(new)} failure classes:\n\n" + "\n\n".join(f.render() for f in new)

    def summary(self) -> str:
        total = sum(sum(c.values()) for c in self.stats.values())
        lines = [f"mneme fuzz: {total} requests in {time.monotonic() - self.started:.0f}s, "
                 f"peak server RSS {self.peak_rss / 2**20:.0f} MiB, "
                 f"{self.generation} server start(s), {len(self.failures)} failure classes"]
        for rpc in sorted(self.stats):
            c = self.stats[rpc]
            lines.append(f"  {rpc:26} {sum(c.values()):5}  " + ", ".join(
                f"{k} {v}" for k, v in c.most_common()))
        for rpc in sorted(self.refused):
            lines.append(f"  refused {rpc}: " + ", ".join(
                f"{k} {v}" for k, v in self.refused[rpc].most_common(8)))
        if self.skipped:
            lines.append("  not sent: " + ", ".join(f"{k}: {v}" for k, v in self.skipped.items()))
        for k in self.order:
            f = self.failures[k]
            lines.append(f"  FAIL [{f.count}x] {f.rpc} ({k[1]}): {k[2]}")
        return "\n".join(lines)


SEED_TEXTS = (
    "Alice moved to Lisbon last May and works at Acme Corp as a data engineer.",
    "Bob: I ran my first marathon in Berlin yesterday, it took me four hours.",
    "Carol adopted a cat named Miso in 2019; she volunteers at the animal shelter.",
    "Alice: My sister Dana is visiting me next week, we will go to Sintra.",
)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    """The harness over one ``mneme up`` (offline extractor) for the whole module."""
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    try:
        yield h
    finally:
        h.close()
        report = h.summary() + f"\n  SIGTERM to exit of the last server: {h.stop_s:.1f}s"
        detail = "\n\n".join(h.failures[k].render() for k in h.order)
        path = Path(os.environ.get("MNEME_FUZZ_REPORT") or h.root / "report.txt")
        path.write_text(report + "\n\n" + detail + "\n")
        REPORTS.append(f"{report}\n  full report: {path}")


def pytest_terminal_summary(terminalreporter):
    for r in REPORTS:
        terminalreporter.write_sep("-", "mneme fuzz summary")
        terminalreporter.write_line(r)
