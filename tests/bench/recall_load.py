"""Recall and retain under load, side by side with a Hindsight peer (issue 13's judge).

What it measures, per system, on the same machine in the same run:

* **sync retain items/s**: the first half of every conversation's sessions (per bank, in
  session order) retained with sync calls, one batch per session (≤ 50 items), one client;
  items / wall time of the calls.
* **fully processed items/s**: after the sync phase has drained (its drain time is shown
  too: how long after the last sync retain the background work went idle), the other half
  is retained, the same batches, mneme asynchronously, Hindsight synchronously (its async
  retain refuses a batch whose items share a document id, and a batch here is one
  session: one document); items / time from the first request until all background work
  is done. mneme: every consumer group's lag on every bank's partition is 0 and no
  operation is pending (``GetBankStats``), consolidation into observations included.
  Hindsight: ``GET …/operations?status=pending`` and ``?status=processing`` report 0 for
  every bank.
* ``--facts N``: then every bank is topped up with sync retains of further conversations
  of ``--data`` (cycling, the bank's own included, each pass under new document ids
  ``fill<k>/<document id>``) until mneme's bank holds N facts; exactly the same batches go
  to the peer (its fact count is reported as it comes out). Drained before recall.
* **recall**: every question of categories 1–4 with evidence (``mneme.locomo.questions``)
  is recalled in its conversation's bank (budget mid, max_tokens 4096, types world +
  experience on both sides), the banks' questions interleaved; for each client count
  (``--clients``, default 1 4 16) that many threads, each with its own client (gRPC
  channel / keep-alive HTTP connection), take the next query until all are done:
  p50/p95 latency (ms, nearest rank) and QPS (answered queries / wall time). Each side is
  warmed first with 3 unmeasured queries per bank.
* **bank stats**: GetBankStats (the peer: its stats endpoint) of the largest bank 30
  times after the recall phase, median and slowest in the notes; with ``--keep`` over
  a data dir that holds the banks, also the first call the new server answers.
* **RSS**: at the end, the summed RSS (psutil) of the server's process tree: mneme's
  ``mneme up``, its children and its embedded graph server (redis-server with FalkorDB,
  a child of its supervisor since 2026-12-06, daemonised before: :func:`graph_servers`;
  before 2026-12-04 it was left out), and the same processes' PSS as a note (RSS counts a file mapped twice, as
  Qdrant Edge maps its vectors, twice); for the peer the process tree
  listening on ``--peer-url``'s port. The peer's PostgreSQL (``--peer-db-port``) is shown
  apart, as summed PSS (its backends share ``shared_buffers``), and is not in ``rss_mb``.

mneme runs as a real ``mneme up`` subprocess (``tests.e2e.server.Server``) on a fresh data
dir, one bank per conversation, driven through ``mneme.client.MnemeClient``; it is stopped
before the peer is driven, so the two never compete for the cores. The peer (Hindsight
1.1.0 REST, ``../shared/peers/hindsight/README.md``) gets the same banks (deleted first if
they exist), items (content, timestamp, document id, metadata), batches and queries.

Prints a table (rich) with the ratios mneme / Hindsight, the phase times, and with
``--json`` as its last stdout line one object: ``{"facts", "clients": {"1": {"p50_ms",
"p95_ms", "qps"}, ...}, "retain_items_per_s": {"sync", "full"}, "rss_mb", "peer": {the
same keys, or null}}`` (``facts``: facts per bank, the mean over the banks). Progress and
phase notes go to stderr. Not part of ``make test``: no assertion on any figure.

Usage: python tests/bench/recall_load.py --data FILE [--conversations ID ...] [--facts N]
       [--clients 1 4 16] [--peer-url URL] [--peer-db-port 55432] [--max-queries N] [--json]
       [--keep DIR]
``make bench-load`` runs it on the dev split (``PEER_URL=http://127.0.0.1:18888`` adds the peer).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlparse

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.e2e.server when run as a script
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from mneme import locomo  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from tests.e2e.server import Server  # noqa: E402

BATCH = 50
#: Facts per step of the fill's rate series (sync items/s while the bank held 0–10k, ...).
FILL_BUCKET = 10_000
BUDGET = "mid"
MAX_TOKENS = 4096
TYPES = ("world", "experience")
WARMUP_PER_BANK = 3
POLL_S = 0.5
DRAIN_TIMEOUT_S = 3600.0


# ---- workload -----------------------------------------------------------------------------

@dataclass
class Workload:
    """What both sides get: per bank the sync and async batches (lists of retain-item
    dicts), the fill source, and the interleaved (bank, question) queries."""

    banks: list[str]
    sync: dict[str, list[list[dict]]]
    rest: dict[str, list[list[dict]]]
    fill_source: list[list[dict]]  # batches of every conversation of the file, in order
    queries: list[tuple[str, str]]
    fill: dict[str, list[list[dict]]] = field(default_factory=dict)  # decided by mneme's run


def batches_of(conv: dict) -> list[list[dict]]:
    """One batch per session, split at ``BATCH`` items."""
    out = []
    for s in locomo.sessions(conv):
        out += [s.items[i:i + BATCH] for i in range(0, len(s.items), BATCH)]
    return out


def workload(data: Path, conversations: list[str], max_queries: int | None) -> Workload:
    """The workload for ``conversations`` of ``data`` (all when empty). Raises SystemExit
    when none matches."""
    every = locomo.load(data)
    convs = [c for c in every if not conversations or c["sample_id"] in conversations]
    if not convs:
        raise SystemExit(f"no conversations {conversations} in {data}")
    banks, sync, rest, per_bank_q = [], {}, {}, []
    for c in convs:
        sid = c["sample_id"]
        b = batches_of(c)
        half = (len(b) + 1) // 2
        banks.append(sid)
        sync[sid], rest[sid] = b[:half], b[half:]
        per_bank_q.append([(sid, q["question"]) for q in locomo.questions(c) if q.get("evidence")])
    # interleaved so concurrent clients hit every bank at once, as many agents would
    queries = [q for row in itertools.zip_longest(*per_bank_q) for q in row if q]
    if max_queries:
        queries = queries[:max_queries]
    fill_source = [b for c in every for b in batches_of(c)]
    return Workload(banks, sync, rest, fill_source, queries)


def fill_batches(source: list[list[dict]], start: int, n: int, pass_len: int) -> list[list[dict]]:
    """Batches ``start .. start+n`` of ``source`` repeated endlessly, each pass ``k`` (from 1)
    under document ids ``fill<k>/<document id>``."""
    out = []
    for i in range(start, start + n):
        k = i // pass_len + 1
        out.append([{**it, "document_id": f"fill{k}/{it['document_id']}"}
                    for it in source[i % pass_len]])
    return out


# ---- the two systems behind one interface -------------------------------------------------

class MnemeSide:
    """A fresh ``mneme up`` subprocess, driven over gRPC."""

    name = "mneme"
    async_rest = True  # the second half as async retains

    def __init__(self, tmp: Path):
        tmp.mkdir(parents=True, exist_ok=True)
        self.server = Server(tmp / "data")
        self.reused = (tmp / "data").exists()

    def start(self) -> None:
        self.server.start()
        self.client = self.server.client()

    def stop(self) -> None:
        self.client.close()
        self.server.stop()

    def create_bank(self, bank: str) -> None:
        self.client.upsert_bank(bank)

    def retain(self, bank: str, items: list[dict], async_: bool) -> None:
        self.client.retain(bank, items, async_=async_)

    def busy(self, bank: str) -> bool:
        s = self.client.bank_stats(bank)
        return bool(s.pending_records or s.pending_operations)

    def facts(self, bank: str) -> tuple[int, int]:
        s = self.client.bank_stats(bank)
        return s.facts, s.observations

    def new_client(self):
        c = self.server.client()
        c.wait_ready(timeout=30)
        return c

    @staticmethod
    def recall(client, bank: str, query: str) -> None:
        client.recall(bank, query, budget=BUDGET, max_tokens=MAX_TOKENS, types=TYPES)

    @staticmethod
    def close_client(client) -> None:
        client.close()

    def pids(self) -> list[int]:
        return [self.server.proc.pid, *graph_servers(self.server.proc.pid)]

    def extra_memory(self) -> tuple[str, float] | None:
        return "mneme PSS MB (the same processes)", tree_mb(self.pids(), pss=True)


class Http:
    """One keep-alive HTTP/1.1 connection; JSON in and out. Reconnects once when the
    server closed an idle connection."""

    def __init__(self, base: str, timeout: float = 600.0):
        u = urlparse(base)
        self.host, self.port, self.prefix = u.hostname, u.port or 80, u.path.rstrip("/")
        self.timeout = timeout
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        """The decoded JSON answer; RuntimeError with the body for a status ≥ 400."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"content-type": "application/json"} if data is not None else {}
        for attempt in (0, 1):
            try:
                self.conn.request(method, self.prefix + path, body=data, headers=headers)
                r = self.conn.getresponse()
                raw = r.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                if attempt:
                    raise
        if r.status >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {raw[:500]!r}")
        return json.loads(raw) if raw else {}

    def close(self) -> None:
        self.conn.close()


class HindsightSide:
    """A running Hindsight REST server at ``url`` (banks under ``/v1/default/banks``)."""

    name = "Hindsight"
    # Its async retain refuses a batch whose items share a document id ("send the batch
    # synchronously"): the second half goes in sync, timed until its operations drain.
    async_rest = False

    def __init__(self, url: str, db_port: int):
        self.url = url.rstrip("/")
        self.db_port = db_port

    def start(self) -> None:
        self.http = Http(self.url)
        self.http.call("GET", "/health")

    def stop(self) -> None:
        self.http.close()

    @staticmethod
    def _bank(bank: str) -> str:
        return f"/v1/default/banks/{quote(bank, safe='')}"

    def create_bank(self, bank: str) -> None:
        try:  # a fresh bank: the same starting point as mneme's fresh data dir
            self.http.call("DELETE", self._bank(bank))
        except RuntimeError as e:
            if "HTTP 404" not in str(e):
                raise
        self.http.call("PUT", self._bank(bank), {})

    @staticmethod
    def _item(it: dict) -> dict:
        return {"content": it["content"], "timestamp": it["timestamp"].isoformat(),
                "document_id": it["document_id"], "metadata": it.get("metadata") or {}}

    def retain(self, bank: str, items: list[dict], async_: bool) -> None:
        self.http.call("POST", self._bank(bank) + "/memories",
                       {"items": [self._item(i) for i in items], "async": async_})

    def busy(self, bank: str) -> bool:
        return any(self.http.call("GET", f"{self._bank(bank)}/operations?status={s}&limit=1")
                   .get("total") for s in ("pending", "processing"))

    def facts(self, bank: str) -> tuple[int, int]:
        by = self.http.call("GET", self._bank(bank) + "/stats").get("nodes_by_fact_type") or {}
        return by.get("world", 0) + by.get("experience", 0), by.get("observation", 0)

    def new_client(self):
        h = Http(self.url)
        h.call("GET", "/health")  # connected before the clock starts, like the gRPC channel
        return h

    def recall(self, client, bank: str, query: str) -> None:
        client.call("POST", self._bank(bank) + "/memories/recall",
                    {"query": query, "budget": BUDGET, "max_tokens": MAX_TOKENS,
                     "types": list(TYPES)})

    @staticmethod
    def close_client(client) -> None:
        client.close()

    def pids(self) -> list[int]:
        return listeners(urlparse(self.url).port or 80)

    def extra_memory(self) -> tuple[str, float] | None:
        pids = listeners(self.db_port)
        if not pids:
            return None
        return f"peer PostgreSQL (port {self.db_port}, PSS, not in RSS)", tree_mb(pids, pss=True)


def listeners(port: int) -> list[int]:
    """Pids of the processes listening on TCP ``port`` (needs the right to see them)."""
    try:
        return sorted({c.pid for c in psutil.net_connections(kind="tcp")
                       if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                       and c.pid})
    except psutil.AccessDenied:
        return []


def graph_servers(pid: int) -> list[int]:
    """Pids of the embedded graph servers (redis-server) of the mneme process ``pid``:
    its descendants of that name (each runs under its supervisor,
    ``mneme.stores.graph_falkor._SUPERVISOR``, a child of mneme)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for c in children:
        with contextlib.suppress(psutil.Error):
            if c.name().startswith("redis-server"):
                out.append(c.pid)
    return out


def tree_mb(pids: list[int], pss: bool = False) -> float:
    """Summed RSS (or PSS) in MB of the processes ``pids`` and all their descendants."""
    seen, total = set(), 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                total += p.memory_full_info().pss if pss else p.memory_info().rss
            except psutil.Error:
                pass
    return round(total / 2**20, 1)


# ---- phases -------------------------------------------------------------------------------

class Runner:
    """Runs the workload on one side and collects its figures."""

    def __init__(self, side, wl: Workload, clients: list[int], facts_target: int | None,
                 console: Console, reuse: bool = False):
        self.side, self.wl, self.clients, self.target = side, wl, clients, facts_target
        self.console, self.reuse = console, reuse
        self.phases: dict[str, float] = {}
        self.notes: dict[str, object] = {}

    def say(self, msg: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] \\[{self.side.name}] {msg}")

    def progress(self) -> Progress:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=self.console, transient=True)

    def wait_idle(self) -> float:
        """Poll until no bank has background work; returns that moment (perf_counter).
        The bank seen busy last is asked first, so a busy system costs one call a poll.
        Raises TimeoutError after ``DRAIN_TIMEOUT_S``."""
        order = list(self.wl.banks)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            busy = next((b for b in order if self.side.busy(b)), None)
            if busy is None:
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.side.name}: bank {busy} still busy after "
                                   f"{DRAIN_TIMEOUT_S:.0f} s")
            order.remove(busy)
            order.insert(0, busy)
            time.sleep(POLL_S)

    def retain_phases(self) -> dict:
        side, wl = self.side, self.wl
        for b in wl.banks:
            side.create_bank(b)
        n_sync = sum(len(x) for b in wl.banks for x in wl.sync[b])
        n_rest = sum(len(x) for b in wl.banks for x in wl.rest[b])
        with self.progress() as prog:
            task = prog.add_task("sync retain", total=n_sync)
            t0 = time.perf_counter()
            for b in wl.banks:
                for batch in wl.sync[b]:
                    side.retain(b, batch, async_=False)
                    prog.advance(task, len(batch))
            t_sync = time.perf_counter()
        self.phases["sync retain"] = t_sync - t0
        self.phases["drain after sync retain"] = self.wait_idle() - t_sync
        self.say(f"sync retain {n_sync} items in {self.phases['sync retain']:.1f} s, drained "
                 f"{self.phases['drain after sync retain']:.1f} s later")
        with self.progress() as prog:
            mode = "async" if side.async_rest else "sync"
            task = prog.add_task(f"{mode} retain", total=n_rest)
            t0 = time.perf_counter()
            for b in wl.banks:
                for batch in wl.rest[b]:
                    side.retain(b, batch, async_=side.async_rest)
                    prog.advance(task, len(batch))
            t_sub = time.perf_counter()
        t_done = self.wait_idle()
        self.notes["second half retained"] = mode
        self.phases["second half: requests"] = t_sub - t0
        self.phases["second half: until fully processed"] = t_done - t0
        self.say(f"{mode} retain of {n_rest} items: requests {t_sub - t0:.1f} s, fully "
                 f"processed {t_done - t0:.1f} s")
        return {"sync": round(n_sync / self.phases["sync retain"], 1),
                "full": round(n_rest / (t_done - t0), 1) if n_rest else None}

    def fill_phase(self) -> None:
        """Top every bank up to the target (mneme decides the batches; the peer replays
        them), sync batches; then drain."""
        side, wl = self.side, self.wl
        if self.target is None:
            return
        src, pass_len = wl.fill_source, len(wl.fill_source)
        decide = not wl.fill
        items = 0
        rates: list[tuple[int, int, float]] = []  # (facts in the bank before, items, s)
        t0 = time.perf_counter()
        with self.progress() as prog:
            for b in wl.banks:
                task = prog.add_task(f"fill {b}", total=self.target)
                if decide:
                    # start at the bank's own conversation's first batch: pass 1 repeats it
                    start = next(i for i, x in enumerate(src)
                                 if x[0]["metadata"]["conversation"] == b)
                    done: list[list[dict]] = []
                    facts = side.facts(b)[0]
                    while facts < self.target:
                        chunk = fill_batches(src, start + len(done), 5, pass_len)
                        c0, n0 = time.perf_counter(), items
                        for batch in chunk:
                            side.retain(b, batch, async_=False)
                            items += len(batch)
                        rates.append((facts, items - n0, time.perf_counter() - c0))
                        done += chunk
                        facts = side.facts(b)[0]
                        prog.update(task, completed=min(facts, self.target))
                    wl.fill[b] = done
                else:
                    for batch in wl.fill[b]:
                        side.retain(b, batch, async_=False)
                        items += len(batch)
                    prog.update(task, completed=self.target)
        t1 = time.perf_counter()
        self.phases["fill (sync retain)"] = t1 - t0
        self.phases["drain after fill"] = self.wait_idle() - t1
        self.notes["fill items"] = items
        self.notes["fill items/s (sync)"] = round(items / (t1 - t0), 1) if items else None
        if rates:  # how retain slows as the bank grows: sync items/s per 10k facts held
            by: dict[int, list[float]] = {}
            for f, n, s in rates:
                acc = by.setdefault(f // FILL_BUCKET * FILL_BUCKET, [0, 0.0])
                acc[0] += n
                acc[1] += s
            self.notes["fill items/s by facts held"] = ", ".join(
                f"{k // 1000}k: {n / s:.1f}" for k, (n, s) in sorted(by.items()))
        self.say(f"fill: {items} items in {t1 - t0:.1f} s")

    def stats_phase(self, calls: int = 30) -> None:
        """Bank statistics (GetBankStats / Hindsight's stats) of the largest bank,
        ``calls`` times in a row: the median and the slowest (ms) into the notes."""
        bank = max(self.wl.banks, key=lambda b: self.side.facts(b)[0])
        lat = []
        for _ in range(calls):
            t0 = time.perf_counter()
            self.side.facts(bank)
            lat.append((time.perf_counter() - t0) * 1000)
        lat.sort()
        self.notes[f"bank stats p50 / max of {calls} calls (ms)"] = \
            f"{lat[len(lat) // 2]:.1f} / {lat[-1]:.1f}"

    def recall_phase(self) -> dict:
        side, qs = self.side, self.wl.queries
        warm = side.new_client()
        t0 = time.perf_counter()
        for b in self.wl.banks:
            for _, q in [x for x in qs if x[0] == b][:WARMUP_PER_BANK]:
                side.recall(warm, b, q)
        side.close_client(warm)
        self.phases["recall warm-up"] = time.perf_counter() - t0
        out = {}
        for n in self.clients:
            lat: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()
            it = iter(qs)
            conns = [side.new_client() for _ in range(n)]
            start = threading.Barrier(n + 1)

            def work(conn):
                start.wait()
                while True:
                    with lock:
                        nxt = next(it, None)
                    if nxt is None:
                        return
                    t = time.perf_counter()
                    try:
                        side.recall(conn, *nxt)
                    except Exception as e:  # noqa: BLE001 — counted and shown, not fatal
                        with lock:
                            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                        continue
                    ms = (time.perf_counter() - t) * 1000
                    with lock:
                        lat.append(ms)

            threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in conns]
            for t in threads:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            for c in conns:
                side.close_client(c)
            lat.sort()
            res = {"p50_ms": round(lat[len(lat) // 2], 1) if lat else None,
                   "p95_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.95))], 1) if lat else None,
                   "qps": round(len(lat) / wall, 1)}
            out[str(n)] = res
            self.phases[f"recall, {n} client" + ("s" if n != 1 else "")] = wall
            if errors:
                self.notes[f"recall errors, {n} clients"] = len(errors)
                self.say(f"[red]{len(errors)} recall errors with {n} clients, first: {errors[0]}")
            self.say(f"{n} client(s): {len(lat)} queries in {wall:.1f} s, p50 {res['p50_ms']} ms, "
                     f"p95 {res['p95_ms']} ms, {res['qps']} QPS")
        return out

    def run(self) -> dict:
        t0 = time.perf_counter()
        self.side.start()
        self.phases["start"] = time.perf_counter() - t0
        try:
            if self.reuse:  # a kept data dir: the banks exist, and this server is new
                t1 = time.perf_counter()
                self.side.facts(self.wl.banks[0])
                self.notes["bank stats, first call after start (ms)"] = round(
                    (time.perf_counter() - t1) * 1000, 1)
            if self.reuse and all(self.side.facts(b)[0] >= (self.target or 1)
                                  for b in self.wl.banks):
                # a kept data dir that already holds the banks: measure recall only
                self.notes["retain"] = "skipped: banks reused from --keep"
                retain = {"sync": None, "full": None}
            else:
                retain = self.retain_phases()
                self.fill_phase()
            counts = [self.side.facts(b) for b in self.wl.banks]
            facts = round(statistics.fmean(f for f, _ in counts))
            self.notes["facts (all banks)"] = sum(f for f, _ in counts)
            self.notes["observations (all banks)"] = sum(o for _, o in counts)
            self.say(f"{facts} facts per bank (mean), "
                     f"{self.notes['observations (all banks)']} observations in all")
            clients = self.recall_phase()
            self.stats_phase()
            rss = tree_mb(self.side.pids())
            extra = self.side.extra_memory()
            if extra:
                self.notes[extra[0]] = extra[1]
        finally:
            self.side.stop()
        return {"facts": facts, "clients": clients, "retain_items_per_s": retain, "rss_mb": rss}


# ---- report -------------------------------------------------------------------------------

def ratio(a, b) -> str:
    return f"{a / b:.2f}×" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "–"


def report(res: dict, runners: list[Runner], wl: Workload, console: Console) -> None:
    peer = res["peer"]
    cols = ["", "mneme"] + (["Hindsight", "mneme / Hindsight"] if peer else [])
    t = Table(*cols, title=f"recall/retain load ({len(wl.banks)} banks: {', '.join(wl.banks)}; "
                           f"{len(wl.queries)} queries, budget {BUDGET}, max_tokens {MAX_TOKENS}, "
                           f"types {'+'.join(TYPES)}; {os.cpu_count()} cores)")

    def row(label, a, b=None, r=True):
        cells = [label, "–" if a is None else str(a)]
        if peer:
            cells += ["–" if b is None else str(b), ratio(a, b) if r else ""]
        t.add_row(*cells)

    row("facts per bank (mean)", res["facts"], peer and peer["facts"])
    for key, label in (("sync", "sync retain items/s (batches ≤ 50)"),
                       ("full", "fully processed retain items/s (incl. observations)")):
        row(label, res["retain_items_per_s"][key], peer and peer["retain_items_per_s"][key])
    for n in res["clients"]:
        a, b = res["clients"][n], peer and peer["clients"][n]
        who = f"{n} client" + ("s" if n != "1" else "")
        row(f"recall p50 ms, {who}", a["p50_ms"], b and b["p50_ms"])
        row(f"recall p95 ms, {who}", a["p95_ms"], b and b["p95_ms"])
        row(f"recall QPS, {who}", a["qps"], b and b["qps"])
    row("server RSS MB (process tree; mneme's with its graph server)", res["rss_mb"],
        peer and peer["rss_mb"])
    notes = [k for r in runners for k in r.notes]
    for k in dict.fromkeys(notes):
        row(k, runners[0].notes.get(k), runners[1].notes.get(k) if peer else None, r=False)
    phases = [k for r in runners for k in r.phases]
    for k in dict.fromkeys(phases):
        vals = [f"{r.phases[k]:.1f}" if k in r.phases else None for r in runners]
        row(f"time: {k} (s)", vals[0], vals[1] if peer else None, r=False)
    Console(width=160).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description="recall/retain load benchmark, mneme vs Hindsight")
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--conversations", nargs="*", default=[])
    ap.add_argument("--facts", type=int, default=None,
                    help="top every bank up to N facts before the recall phase")
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--peer-url", default=None, help="Hindsight REST server, e.g. http://127.0.0.1:18888")
    ap.add_argument("--peer-db-port", type=int, default=55432,
                    help="the peer's PostgreSQL port (its memory is shown apart)")
    ap.add_argument("--max-queries", type=int, default=None, help="only the first N queries")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on the last line")
    ap.add_argument("--keep", type=Path, default=None,
                    help="mneme's data dir goes to KEEP/data and stays; a later run with the same "
                         "KEEP whose banks already hold the facts skips retain and fill (recall only)")
    args = ap.parse_args()
    console = Console(stderr=True)
    wl = workload(args.data, args.conversations, args.max_queries)
    runners = []
    with tempfile.TemporaryDirectory(prefix="mneme-load-") as tmp:
        side = MnemeSide(args.keep or Path(tmp))
        r = Runner(side, wl, args.clients, args.facts, console, reuse=side.reused)
        runners.append(r)
        res = r.run()
    res["peer"] = None
    if args.peer_url:
        r = Runner(HindsightSide(args.peer_url, args.peer_db_port), wl, args.clients,
                   args.facts, console)
        runners.append(r)
        res["peer"] = r.run()
    report(res, runners, wl, console)
    if args.json:
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
