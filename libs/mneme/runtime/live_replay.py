"""Replay while serving: search's projections (and, embedded, consolidation's) rebuilt
into a new store generation (:mod:`mneme.generations`) next to the live one, checked,
then switched in place; in the distributed topology a consolidation replica's
observation projection the same way on its own."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mneme.bank_catalog import bank_ids
from mneme.bus.consumer import Consumer
from mneme.generations import (Generation, drop_stores, generation_group, local_path,
                               remove_file, remove_local)

log = logging.getLogger("mneme")

#: Units sampled per bank by the check before a switch (each asked of every store:
#: :func:`_probes`), banks sampled, and the top ids compared per answer.
CHECK_QUERIES, CHECK_BANKS, CHECK_TOP = 3, 10, 10
#: Looks at a bank the live group writes meanwhile, and differences reported at most.
CHECK_ATTEMPTS, CHECK_PROBLEMS = 5, 50
#: Least mean agreement (shared ids / ids) of the sampled answers' top ids. Below 1:
#: the vector index is approximate (HNSW), and two builds of one data set may order a
#: near-tie differently.
CHECK_AGREEMENT = 0.8


#: What a FAILED generation's error says once its stores are deleted (:meth:`drop_failed`).
_STORES_DELETED = " (its stores are deleted)"


class ReplayCancelled(RuntimeError):
    """The replay was cancelled (its generation is FAILED, the live one unchanged)."""


class CheckFailed(RuntimeError):
    """The new generation does not match the live one (no switch)."""


@dataclass
class Follower:
    """Another group's projection that a replay rebuilds into the same generation as
    search's stores and switches with them (embedded: consolidation's observation
    store, ``observations.g<n>.db``), or alone (a distributed consolidation replica).

    ``router``: the live group's Router; ``make_router(store, group_id)``: a Router of
    that group over ``store`` that only projects (its restore handlers: recorded
    decisions applied, nothing decided, no model); ``open(g)``: the store of generation
    *g*, opened (it may write without syncing until its ``flush()``, which the replay
    calls once the check passed); ``path(g)``: its file; ``live``: the store serving now (a
    :class:`mneme.generations.Switchable`). The check compares the stores'
    ``counts(bank_id)`` (:meth:`mneme.ports.ObservationStore.counts`): fewer in the new
    store than in the live one is a difference."""

    router: Any
    make_router: Callable[[Any, str], Any]
    open: Callable[[int], Any]
    path: Callable[[int], Path]
    live: Any
    #: Appended to the builder's consumer group (``<group>@g<n><suffix>``): replicas
    #: that share the live group each build under a group of their own.
    suffix: str = ""


class _Build:
    """One group's replay into a generation: a builder consumer under ``gid`` that reads
    the live group's topics (``live``: its Router) and projects them through ``router``
    (nothing appended)."""

    def __init__(self, log_, live, router, gid: str) -> None:
        self.log, self.live, self.gid = log_, live, gid
        log_.reset_group(gid, live.topics)
        self.consumer = _Builder(log_, gid, live.topics, router,
                                 fails_operation=router.fails_operation)
        self.consumer.produce = False  # the outputs of these records are on the log already
        self.tps = [(t, p) for t in live.topics for p in range(log_.partitions(t))]
        self.done = 0
        self.total = 0

    def position(self) -> dict:
        """Where the live group is: the offset after the last record its router was called
        with here, else its committed offset (replicas elsewhere: that)."""
        seen = self.live.positions()
        return {tp: seen.get(tp, self.log.committed(self.live.group_id, *tp)) for tp in self.tps}

    def behind(self, target: dict) -> int:
        """Records between this build's committed offsets and ``target``."""
        return sum(target[tp] - self.log.committed(self.gid, *tp) for tp in self.tps)

    def reached(self, until: dict) -> bool:
        """True once this build's committed offsets are at ``until`` or past it."""
        return all(self.log.committed(self.gid, *tp) >= until.get(tp, 0) for tp in self.tps)

    def own_outputs(self, until: dict) -> int:
        """Project the records beyond ``until`` ((topic, partition) → offset) that the
        live group itself produced on a topic it reads (consolidation's
        ObservationsChanged and OpinionsChanged on ``mneme.memory.v1``); returns how many.

        A group commits each record's offset together with its outputs, which are
        appended at the log's end: the outputs beyond the live group's position are
        those of records before it (its state already holds them: a stopped
        consolidation that had not read its own decisions back, or one held for the
        switch). Without them a build up to that position lacks decisions the live
        state has, and the check would call an intact projection damaged. That holds
        while the live group is held at ``until`` (the switch); while it runs (the
        check's attempts), or on another replica of the service, some of these outputs
        may come from records after ``until``: harmless, since the check only flags a
        bank the build holds less of than live and the build reads them again in order.
        The builder's offsets stay at ``until`` (it reads them again later: idempotent)."""
        from mneme.bus.codec import decode, event_type
        from mneme.bus.sealing import erased_record
        produces = self.live.service.produces
        source = self.live.service.source
        router = self.consumer.handler
        applied = 0
        for tp in self.tps:
            mine = {event_type(t) for t in produces.get(tp[0], ())}
            if not mine:
                continue
            off, end = until.get(tp, 0), self.log.end_offset(*tp)
            while off < end:
                batch = self.log.read(*tp, off, limit=500)
                if not batch:
                    break
                for rec in batch:
                    if (rec.headers.get("ce_source") == source
                            and rec.headers.get("ce_type") in mine
                            and not erased_record(rec)):
                        try:
                            env = decode(rec)
                        except Exception:  # a poison record: the builder counts it
                            continue
                        if env.message is not None:
                            router(env, rec)
                            applied += 1
                off = batch[-1].offset + 1
        return applied


class LiveReplay:
    """Rebuild search's projections from the log into a new generation while the live
    one serves, then switch (DESIGN: every store is a projection of the log).

    ``router``: the live ``search`` group's Router (running in this process or not;
    None: no search stores here, only :attr:`followers`); ``make_router(stores,
    group_id)``: a Router of the same group over other stores; ``generations``: the
    record of this data dir's
    generations (default ``root.generations``). Steps (:meth:`start` runs them in a
    thread, :meth:`run` in the caller's):

    1. open generation *g* (:meth:`mneme.bootstrap.Root.open_stores`, empty) and replay
       the group's topics into it under a consumer group of its own, never past where the
       live group is (:meth:`mneme.router.Router.positions`, else its committed offsets),
       projecting only (nothing is appended; the builder flushes *g*'s stores before
       each commit of its offsets, :meth:`mneme.router.Router.flush`);
    2. check, while the live group goes on: no bank has fewer units in a store than in
       the live generation (more is what the live one could not project, e.g. dead
       letters: ``gained``, repaired by the switch), and the stores of banks with the
       same units answer alike (:data:`CHECK_QUERIES` units of :data:`CHECK_BANKS` banks
       asked of each store, :func:`_probes`; :data:`CHECK_AGREEMENT`; no model is
       called); a bank the live group wrote meanwhile is looked at
       again (up to :data:`CHECK_ATTEMPTS` times), a difference twice;
    3. own stores: hold the live group between two records
       (:meth:`mneme.router.Router.paused`), replay exactly up to there, switch the live
       stores (:class:`mneme.generations.Switchable`) to *g* and record it LIVE; the live
       group goes on from its own offsets, now into *g*. The old generation is RETIRED;
       its stores close after the grace (``MNEME_RETIRE_GRACE_S``; reads begun on them
       end first), and then, being this process's own, are deleted with their record
       (:meth:`drop_retired`): they would otherwise keep content that a later deletion
       removes from the live generation (crypto-shredding destroys keys, not
       projections).
       Shared store servers (:attr:`shared`): *g* is left READY under the consumer group
       its replicas will run under.

    :attr:`followers` (other groups' projections; embedded: consolidation's) are built
    alongside under consumer groups of their own, checked by their per-bank counts, and
    switched in the same step: every live group is held, each replayed exactly up to
    where it is held, then all the stores switch at once.

    A failure or :meth:`cancel` at any step leaves the live generation serving as before
    and records *g* FAILED with the reason (its stores are deleted). Progress and results
    are in :class:`mneme.generations.Generations`. ``force``: switch even when the check
    fails (the live generation is known to be damaged)."""

    def __init__(self, root, router, make_router: Callable | None,
                 followers: list[Follower] | None = None,
                 generations=None) -> None:
        self.root = root
        self.router = router
        self.make_router = make_router
        #: Other groups' projections replayed into the same generation (:class:`Follower`).
        self.followers: list[Follower] = list(followers or [])
        self.generations = generations if generations is not None else root.generations
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._building: int | None = None
        self._retired: dict[int, list] = {}  # generation → its stores, until closed
        self._retired_lock = threading.Lock()
        self._lock = threading.Lock()

    def start(self, force: bool = False) -> Generation:
        """Begin a replay in a background thread; returns its BUILDING record.
        RuntimeError while another replay runs."""
        with self._lock:
            gen = self.generations.begin()
            self._cancel.clear()
            self._building = gen.generation
            self._thread = threading.Thread(target=self._run, args=(gen.generation, force),
                                            name=f"replay-g{gen.generation}", daemon=True)
            self._thread.start()
            return gen

    def run(self, force: bool = False, progress=None) -> Generation:
        """Replay in this thread (as :meth:`start`); returns the final record."""
        with self._lock:
            gen = self.generations.begin()
            self._cancel.clear()
            self._building = gen.generation
        self._run(gen.generation, force, progress)
        return self.generations.get(gen.generation)

    def wait(self, timeout: float | None = None) -> bool:
        """True once no replay runs (False after ``timeout`` seconds)."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def cancel(self, generation: int) -> bool:
        """Stop the replay building ``generation`` (True when it was building)."""
        if self._building != generation:
            return False
        self._cancel.set()
        return True

    def drop(self, generation: int) -> None:
        """Delete a generation's stores and its record, unless it is live (a BUILDING
        one is cancelled first). KeyError when this process knows no such generation (on
        shared store servers any other number is dropped: a replay elsewhere may have
        built it); ValueError for the live one."""
        rec = self.generations.get(generation)
        if rec is None and not self.shared:
            raise KeyError(generation)
        if generation == self.generations.live():
            raise ValueError(f"generation {generation} is live; replay to switch first")
        self._refuse_in_use(generation)
        if rec is not None and rec.state == "BUILDING":
            self.cancel(generation)
            if not self.wait(60):  # its builder still writes: deleting now would race it
                raise ValueError(f"generation {generation} is still stopping its replay; "
                                 "drop it again in a minute")
        with self._retired_lock:
            self._delete(generation)

    def _delete(self, generation: int) -> None:
        """Close ``generation``'s retired stores if still open, delete its stores and
        forget its record (with :attr:`_retired_lock` held)."""
        old = self._retired.pop(generation, None)
        if old is not None:
            _close(old)
        self._discard(generation, None)
        self.generations.forget(generation)

    def drop_retired(self) -> list[int]:
        """Close and delete every RETIRED generation of this process's own stores (its
        files, or store servers only it uses; not :attr:`shared`: there old replicas may
        still serve one) and forget its record; returns their numbers. Called when a
        retired generation's grace ends, when this process closes, and at start (a
        process stopped within the grace left its files). A generation whose stores
        cannot be deleted is logged and kept."""
        if self.shared:
            return []
        return [g for g in (r.generation for r in self.generations.list()
                            if r.state == "RETIRED") if self._drop_retired(g)]

    def drop_failed(self) -> list[int]:
        """Delete the stores of every FAILED generation of this process's own stores that
        may still hold some (a replay stopped by a crash leaves its files: they hold
        content later deletions never reach); the record stays, so ``generations list``
        still says why it failed. Called at start, when no replay can be running. Returns
        their numbers; a generation whose stores cannot be deleted is logged and kept."""
        if self.shared:
            return []
        done = []
        for rec in self.generations.list():
            if rec.state != "FAILED" or rec.error.endswith(_STORES_DELETED):
                continue
            try:
                with self._retired_lock:
                    self._discard(rec.generation, None)
            except Exception:
                log.exception("cannot delete the stores of failed generation %d", rec.generation)
                continue
            self.generations.update(rec.generation, error=rec.error + _STORES_DELETED)
            done.append(rec.generation)
        return done

    def _drop_retired(self, generation: int) -> bool:
        """Close ``generation``'s retired stores if open, delete them (files; on store
        servers its collection, index and graph) and forget its record, if it is still
        RETIRED (a command may have dropped it); True when done. A generation whose stores
        cannot be deleted keeps its record (``generations drop`` retries)."""
        with self._retired_lock:
            rec = self.generations.get(generation)
            if rec is None or rec.state != "RETIRED":
                return False
            try:
                self._delete(generation)
            except Exception:
                log.exception("cannot delete the stores of retired generation %d", generation)
                return False
            log.info("replay: retired generation %d deleted", generation)
            return True

    def _refuse_in_use(self, generation: int) -> None:
        """On shared store servers, RuntimeError when replicas run ``generation`` (its
        consumer group has live members): this process's MNEME_STORE_GENERATION is not
        theirs, and building or dropping it would wipe what they serve."""
        if not self.shared or self.router is None:
            return
        gid = generation_group(self.router.group.name, generation)
        if gid in self.root.log.groups(live_only=True):
            raise RuntimeError(
                f"generation {generation} is served: consumer group {gid} has live members "
                f"(MNEME_STORE_GENERATION here is {self.generations.live()}; set it to the "
                "replicas' value)")

    @property
    def shared(self) -> bool:
        """True on store servers the search replicas share: a replay builds and checks
        the next generation (READY) without switching; the replicas switch when they are
        configured with it (``MNEME_STORE_GENERATION``)."""
        return self.router is not None and not self.root.owns_stores

    # -- the replay --

    def _run(self, g: int, force: bool, progress=None) -> None:
        new, extra, built = None, [], None  # extra: the followers' stores of g, as opened
        behind: list[WriteBehind] = []  # the build's buffers of new's stores
        try:
            self._refuse_in_use(g)
        except Exception as exc:  # nothing of generation g is touched: it is someone's
            log.warning("replay refused: %s", exc)
            self.generations.update(g, state="FAILED", error=str(exc))
            self._building = None
            return
        widening = contextlib.ExitStack()
        try:
            # the log read again from the start names each of a bank's keys many times
            # (every observation's seal: the keys of the facts it cites)
            widening.enter_context(self.root.keyring.widened())
            for f in self.followers:
                remove_file(f.path(g))  # a crashed replay's files, if any
            builds, search = [], None
            if self.router is not None:
                remove_local(self.root.store_urls(g))
                new = self.root.open_stores(g)
                new.reset()  # a server collection of that name from a crashed replay
                # Shared stores: the group the replicas of generation g will run under (they
                # go on from where the replay stops); own stores: the replay's alone.
                gid = (generation_group(self.router.group.name, g) if self.shared
                       else f"{self.router.group_id}@g{g}")
                # writes buffered per consumer batch: a Tantivy commit and a graph round
                # trip per batch, not per record, written while the next batch is
                # handled (nothing reads g before drain_all has waited for them)
                behind = [WriteBehind(s, empty=True, background=True) for s in new.all()]
                # the build accepts a bank's vectors of the model it had before a
                # re-embed that follows on the log (Projections.building)
                built = new.building(*behind)
                search = _Build(self.root.log, self.router, self.make_router(built, gid), gid)
                builds.append(search)
            for f in self.followers:
                extra.append(f.open(g))
                fgid = f"{f.router.group_id}@g{g}{f.suffix}"
                builds.append(_Build(self.root.log, f.router, f.make_router(extra[-1], fgid),
                                     fgid))

            def drain_all(targets: list[dict], outputs: bool = False) -> None:
                for b, until in zip(builds, targets):
                    self._drain(g, b, until, builds, progress)
                    if outputs:  # the live state holds them: so must g (own_outputs)
                        b.own_outputs(until)
                for w in behind:  # every write of g made before it is read or switched
                    w.wait()

            # 1: up to where the live groups are, while they go on.
            for _ in range(20):
                targets = [b.position() for b in builds]
                if all(b.behind(t) <= b.consumer.batch_size for b, t in zip(builds, targets)):
                    break
                drain_all(targets)
            # 2: the check, while the live groups go on: a bank written meanwhile is not
            # comparable and is looked at again; a difference is looked at twice.
            n = 0 if search is None else 1  # the followers' builds come after search's
            for attempt in range(CHECK_ATTEMPTS):
                targets = [b.position() for b in builds]
                drain_all(targets, outputs=True)
                banks = self._banks()
                check = (self._check(new, search.position, targets[0], banks)
                         if search is not None else _no_check(banks))
                if built is not None:  # banks left with another model's vectors
                    check["problems"] += built.unswitched()[:CHECK_PROBLEMS]
                for f, b, store, t in zip(self.followers, builds[n:], extra, targets[n:]):
                    moving, problems = self._check_follower(f, store, b.position, t, banks)
                    check["moving"] += moving
                    check["problems"] += problems
                if not check["moving"] and not check["problems"]:
                    break
                if check["problems"] and attempt >= 1:
                    break
                time.sleep(0.2 * (attempt + 1))
            for c in (b.consumer for b in builds if b.consumer.failures):
                # the live group may have dropped the same records: say so
                check["problems"].append(f"{c.failures} records of {c.group} could not be "
                                         f"projected (last: {c.last_failure})")
            done = sum(b.done for b in builds)
            self.generations.update(g, check=check, records_done=done)
            if check["problems"] and not force:
                raise CheckFailed("; ".join(check["problems"][:5]))
            for store in extra:  # built without syncing (Follower.open): durable from here
                store.flush()
            model = new.embedding_model if new is not None else ""
            if self.shared:
                self.generations.update(g, state="READY", embedding_model=model)
                _close(new.all())
                log.info("replay: generation %d is built and checked (%d records); set "
                         "MNEME_STORE_GENERATION=%d on the search replicas to switch",
                         g, done, g)
                return
            # 3: the switch, holding every live group between two records (in a fixed
            # order; no handler waits for another router): replay each exactly up to
            # where it is held, then switch all the stores at once; the groups go on
            # from their own offsets, now into g.
            with contextlib.ExitStack() as held:
                nexts = [held.enter_context(b.live.paused()) for b in builds]
                drain_all([{tp: n.get(tp, b.log.committed(b.live.group_id, *tp))
                            for tp in b.tps} for b, n in zip(builds, nexts)], outputs=True)
                # The builders flushed before each commit; flush again so that nothing of
                # g is only in memory when it goes live (nothing to do when clean). The
                # retired stores are flushed when they close.
                old = []
                if new is not None:
                    new.flush()
                    old = [s.swap(n) for s, n in zip(self.root.stores.all(), new.all())]
                    # a re-embed's generation holds another model's vectors than the old
                    self.root.stores.embedding_model = model
                old += [f.live.swap(store) for f, store in zip(self.followers, extra)]
                prev = self.generations.live()
                done = sum(b.done for b in builds)
                self.generations.update(g, state="LIVE", records_done=done,
                                        embedding_model=model)
            self._retire(prev, old)
            log.info("replay: generation %d is live (%d records; generation %d retired)",
                     g, done, prev)
        except BaseException as exc:
            log.warning("replay of generation %d failed, generation %d still serves: %s",
                        g, self.generations.live(), str(exc) or type(exc).__name__)
            try:
                for w in behind:  # no write of g in flight while it is deleted
                    with contextlib.suppress(Exception):
                        w.wait()
                _close(extra)
                self._discard(g, new)
            except Exception:  # e.g. the store server is away: drop it later, by command
                log.exception("replay: cannot delete the stores of generation %d", g)
            self.generations.update(g, state="FAILED", error=str(exc) or type(exc).__name__)
            if not isinstance(exc, Exception):
                raise
        finally:
            widening.close()
            self._building = None

    def _drain(self, g: int, b: "_Build", until: dict, builds: list, progress) -> None:
        """Run ``b``'s builder until its committed offsets reach ``until``; records the
        progress of all ``builds`` in generation ``g``'s record (twice a second at most).
        ReplayCancelled on :meth:`cancel`."""
        c = b.consumer
        c.until = until
        b.total = sum(until.values())
        saved = 0.0
        while True:
            if self._cancel.is_set():
                raise ReplayCancelled("cancelled")
            n = c.run_once()
            b.done += n
            done, total = sum(x.done for x in builds), sum(x.total for x in builds)
            if n and progress:
                progress(done, total)
            if time.monotonic() - saved > 0.5:
                self.generations.update(g, records_done=done, records_total=total)
                saved = time.monotonic()
            if n == 0 and b.reached(until):
                return
            if n == 0:  # Kafka: a fetch may come back empty early
                time.sleep(0.05)

    def _banks(self) -> list[str]:
        """Every bank of this process's catalog."""
        return bank_ids(self.root.catalog)

    def _moving(self, router, banks, at: dict, position: Callable[[], dict]) -> set[str]:
        """Those of ``banks`` whose partition ``router``'s live group has moved past ``at``
        (now: ``position()``) or is in the middle of: not comparable now."""
        from mneme.bus import partition_for
        if not banks:
            return set()
        busy = router.in_progress()  # its units may be half written in the live stores
        now_at = position()
        moved = {tp for tp, off in at.items() if now_at[tp] != off or busy == tp}
        return {b for b in banks
                if any(p == partition_for(b, self.root.log.partitions(t)) for t, p in moved)}

    def _check_follower(self, f: Follower, new, position: Callable[[], dict], at: dict,
                        banks: list[str]) -> tuple[int, list[str]]:
        """Compare a follower's store of the new generation, replayed up to ``at``, with
        its live one, for each of ``banks`` (their ``counts``): returns (banks not
        comparable now, differences)."""
        differ = {}
        for b in banks:
            n_live, n_new = f.live.counts(b), new.counts(b)
            if any(z < a for a, z in zip(n_live, n_new)):
                differ[b] = f"bank {b}: {f.router.group.name} has {n_new}, live {n_live}"
        moving = self._moving(f.router, differ, at, position)
        ahead = {b for b in differ if b not in moving and self._ahead(f, b, at)}
        for b in ahead:
            log.info("replay: %s's live projection of bank %s holds decisions beyond its "
                     "group's offsets (a stop before their commit); not compared",
                     f.router.group.name, b)
        return len(moving), [d for b, d in differ.items()
                             if b not in moving and b not in ahead][:CHECK_PROBLEMS]

    def _ahead(self, f: Follower, bank_id: str, at: dict) -> bool:
        """True when ``f``'s live store already holds the decision of the bank's first
        record at or after ``at`` that its group handles (:meth:`ObservationStore.decision
        <mneme.ports.ObservationStore.decision>`, recorded in the transaction of its
        writes): the process stopped (a kill) after that transaction and before the log
        committed the record, so the live state is ahead of the log, not damaged (the
        record comes again and gets that decision). Its group handles records in order,
        so the first one tells."""
        from mneme.bus import partition_for
        from mneme.bus.codec import decode
        from mneme.router import meta_of
        decision = getattr(f.live, "decision", None)
        if decision is None:
            return False
        source = f.router.service.source
        for t in f.router.topics:
            p = partition_for(bank_id, self.root.log.partitions(t))
            off, end = at.get((t, p), 0), self.root.log.end_offset(t, p)
            while off < end:
                batch = self.root.log.read(t, p, off, limit=500)
                if not batch:
                    break
                for rec in batch:
                    h = rec.headers
                    if (h.get("ce_subject") != bank_id or h.get("ce_source") == source
                            or h.get("ce_type") not in f.router.types):
                        continue  # another bank's, its own output, or not handled
                    try:
                        return decision(meta_of(decode(rec), rec).id) is not None
                    except Exception:  # undecodable: its live handler dead-letters it
                        return False
                off = batch[-1].offset + 1
        return False

    def _check(self, new, position: Callable[[], dict], at: dict, banks: list[str]) -> dict:
        """Compare ``new``, replayed up to ``at`` ((topic, partition) → offset), with the
        live stores for each of ``banks``: per bank unit counts (fewer is a problem, more
        is ``gained``), then each store's answers about sampled units of banks with equal
        counts (:func:`_probes`; ``recalls``: the answers compared). A bank whose partition the live group
        has moved past ``at`` (``position()``) is not comparable and is counted as
        ``moving``. Returns {"banks", "units", "recalls", "agreement", "moving",
        "gained", "problems": [...]}."""
        live = self.root.stores
        units, differ, more = 0, {}, set()
        for b in banks:
            for kind, a, z in zip(("vector", "text", "graph"), live.all(), new.all()):
                n_live, n_new = a.count(b), z.count(b)
                units += n_new
                if n_new > n_live:  # what the live one could not project (dead letters)
                    more.add(b)
                elif n_new < n_live:  # the switch would lose units
                    differ.setdefault(b, []).append(
                        f"bank {b}: {kind} store has {n_new} units, live {n_live}")
        moving = self._moving(self.router, {*differ, *more}, at, position)
        problems = []
        for b, found in differ.items():
            if b not in moving:
                problems += found
        gained = more - moving - set(differ)
        if len(problems) > CHECK_PROBLEMS:
            problems = problems[:CHECK_PROBLEMS] + [
                f"... and {len(problems) - CHECK_PROBLEMS} more differences"]
        scores = []
        alike = [b for b in banks if b not in differ and b not in more]  # same units
        # a re-embed's new generation: its vectors and the live ones are of two models
        # (their kNN answers cannot agree); its text and graph are still compared
        same_model = (not live.embedding_model or not new.embedding_model
                      or live.embedding_model == new.embedding_model)
        for b in alike[:CHECK_BANKS]:
            facts, _ = new.vectors.scroll(b, CHECK_QUERIES)
            facts = new.vectors.get(b, [f.id for f in facts], with_vectors=True)
            for i, f in enumerate(facts):
                for ids_a, ids_z in _probes(live, new, f, graph=i == 0,
                                            vectors=same_model):
                    scores.append(len(set(ids_a) & set(ids_z))
                                  / max(len(ids_a), len(ids_z), 1))
        agreement = sum(scores) / len(scores) if scores else 1.0
        if agreement < CHECK_AGREEMENT:
            problems.append(f"sampled store answers agree {agreement:.2f} < {CHECK_AGREEMENT}")
        return {"banks": len(banks), "units": units, "recalls": len(scores),
                "agreement": round(agreement, 3), "moving": len(moving),
                "gained": len(gained), "problems": problems}

    def _retire(self, generation: int, stores) -> None:
        self._retired[generation] = stores

        def close() -> None:
            try:
                if self.shared:  # old replicas may serve it: kept until dropped by command
                    with self._retired_lock:
                        if self._retired.pop(generation, None) is not None:
                            _close(stores)
                else:
                    self._drop_retired(generation)
            except Exception:  # a timer thread: nobody else would see it
                log.exception("replay: closing retired generation %d failed", generation)
        t = threading.Timer(self.root.settings.retire_grace_s, close)
        t.daemon = True
        t.start()

    def _discard(self, generation: int, stores) -> None:
        """Delete ``generation``'s stores: ``stores`` when open, else (on servers) opened
        to be dropped; local files removed."""
        if self.router is not None:
            urls = self.root.store_urls(generation)
            # store servers (shared, or this process's own): opened to drop their
            # collection, index or graph; local files are removed by name
            if stores is None and any(local_path(u) is None for u in urls.values()):
                stores = self.root.open_stores(generation)
            drop_stores(stores, urls)
        for f in self.followers:
            remove_file(f.path(generation))

    def close(self) -> None:
        """Cancel a running replay; close retired stores still open (and delete them
        where they are this process's own files, :meth:`drop_retired`)."""
        if self._building is not None:
            self._cancel.set()
            self.wait(30)
        try:
            self.drop_retired()
        except Exception:  # e.g. generations.json unreadable: still close what is open
            log.exception("replay: deleting retired generations failed")
        with self._retired_lock:
            for g in list(self._retired):
                _close(self._retired.pop(g))


class WriteBehind:
    """A store port that buffers writes (``upsert``, ``delete``, ``delete_where``) until
    :meth:`flush`, which applies them in order -- consecutive upserts as one call, the
    last version of a unit kept -- then flushes the store. Any other call flushes first,
    so a read sees every write made before it. For a replay's builder: its consumer
    flushes before each commit of its offsets (:attr:`mneme.router.Group.durable`), so a
    batch of records costs one write per store instead of one per record. At most
    :attr:`limit` units wait; more flush at once. ``delete_where`` returns [] (the ids
    are not known until the flush). Not thread-safe: one consumer's.

    ``empty``: the store was empty when wrapped and is written only through this
    wrapper (a new generation), so a delete of what was never written here is dropped
    (a replayed retain deletes its document's earlier units first, which in a new
    generation are almost never there; kept, each would end a run of upserts).

    ``background``: :meth:`flush` hands the batch to a thread of its own and returns;
    the next flush, any other call and :meth:`wait` wait for it first (and raise its
    error). So the stores' writes of one batch overlap the decoding and handling of the
    next, and the three stores' writes overlap each other (the graph's in its server's
    process). A flush then no longer means durable on return, which only a build of a
    new generation may accept: nothing reads it before :meth:`wait`, and a failed write
    fails the replay (its generation is discarded), whichever batch's commit it
    surfaces in."""

    limit = 5_000

    def __init__(self, target, empty: bool = False, background: bool = False) -> None:
        self.target = target
        self._ops: list[tuple[str, tuple]] = []
        self._units = 0
        # what was written here, when the store started empty (None: unknown)
        self._written: dict[str, tuple[set, set]] | None = {} if empty else None
        self._background = background
        self._job: threading.Thread | None = None  # the batch being written (background)
        self._job_ops: list[tuple[str, tuple]] = []  # what it has not applied yet
        self._job_error: BaseException | None = None

    def _never_written(self, bank_id: str, *, document_id=None, ids=None) -> bool:
        if self._written is None:
            return False
        if bank_id not in self._written:
            return True
        units, docs = self._written[bank_id]
        if ids is not None:
            return not any(i in units for i in ids)
        return document_id is not None and document_id not in docs

    def upsert(self, facts) -> None:
        facts = list(facts)
        if self._written is not None:
            for f in facts:
                units, docs = self._written.setdefault(f.bank_id, (set(), set()))
                units.add(f.id)
                docs.add(f.document_id)
        if self._ops and self._ops[-1][0] == "upsert":
            self._ops[-1][1][0].extend(facts)
        else:
            self._ops.append(("upsert", (facts,)))
        self._units += len(facts)
        if self._units >= self.limit:
            self.flush()

    def delete(self, bank_id: str, ids) -> None:
        ids = list(ids)
        if not self._never_written(bank_id, ids=ids):
            self._ops.append(("delete", (bank_id, ids)))

    def delete_where(self, bank_id: str, document_id: str | None = None) -> list[str]:
        from mneme.stores.filters import check_document_id
        check_document_id(document_id)  # refused now, as the store would
        if not self._never_written(bank_id, document_id=document_id):
            self._ops.append(("delete_where", (bank_id, document_id)))
        return []

    def flush(self) -> None:
        """Apply the buffered writes in order, then make them durable (the store's
        flush); with ``background``, in a thread, after the previous batch's (whose
        error is raised here). On an error the writes not yet applied stay buffered for
        the next try (re-applying one is harmless: each write is idempotent)."""
        self.wait()
        ops, self._ops, self._units = self._ops, [], 0
        if not self._background:
            try:
                self._apply(ops)
            finally:
                self._ops[:0] = ops  # what was not applied, before anything newer
            return
        self._job_ops = ops
        self._job = threading.Thread(target=self._run_job, name="mneme-write-behind",
                                     daemon=True)
        self._job.start()

    def wait(self) -> None:
        """Wait until the batch a background :meth:`flush` handed over is written; its
        error, if any, is raised (its writes not applied stay buffered)."""
        job, self._job = self._job, None
        if job is None:
            return
        job.join()
        error, self._job_error = self._job_error, None
        self._ops[:0], self._job_ops = self._job_ops, []
        if error is not None:
            raise error

    def _run_job(self) -> None:
        try:
            self._apply(self._job_ops)
        except BaseException as exc:  # raised by the next flush or wait
            self._job_error = exc

    def _apply(self, ops: list[tuple[str, tuple]]) -> None:
        """Apply ``ops`` in order, removing each once applied, then flush the store."""
        while ops:
            op, args = ops[0]
            if op == "upsert":  # the last version of each unit, in first-seen order
                args = (list({(f.bank_id, f.id): f for f in args[0]}.values()),)
            getattr(self.target, op)(*args)
            ops.pop(0)
        self.target.flush()

    def __getattr__(self, name: str):
        self.wait()
        self._apply(self._ops)
        return getattr(self.target, name)


class _Builder(Consumer):
    """The replay's consumer: what the live group would dead-letter is counted and kept
    for the check's report instead (a replay appends nothing)."""

    failures = 0
    last_failure = ""

    def _dead_letter(self, rec, exc, attempts, env):
        self.failures += 1
        self.last_failure = f"{rec.topic}[{rec.partition}]@{rec.offset}: {exc!r}"[:500]
        log.warning("replay (%s): %s[%d]@%d could not be projected after %d attempts: %r",
                    self.group, rec.topic, rec.partition, rec.offset, attempts, exc)
        return []  # nothing to append: the check reports it


def _probes(live, new, fact, graph: bool = True, vectors: bool = True
            ) -> list[tuple[list[str], list[str]]]:
    """The check's comparisons for one sampled unit ``fact`` (with its embedding): the
    top :data:`CHECK_TOP` ids each store of ``live`` and of ``new`` answers to the
    questions recall asks of it -- the vector store's kNN of the unit's own embedding,
    the text store's BM25 of its text, the graph's spreading activation from the unit
    and its entities (``graph``: the check asks it of one unit per bank; a spread
    read with Cypher costs a few round trips per hop) -- as (live ids, new ids) pairs;
    a question neither answers is left out (nothing to compare). Per store rather than
    through recall: a broken store cannot hide behind the other arms of a fused
    ranking, and nothing needs a model (no query embedding, no query parsing), so an
    offline replay loads none. ``vectors`` False: no kNN (the two generations' vectors
    are of two models: a re-embed)."""
    b = fact.bank_id
    asks = [lambda s: s.text.search(b, fact.text[:500], CHECK_TOP)]
    if graph:
        asks.append(lambda s: s.graph.spread(b, {fact.id: 1.0},
                                             [e.id for e in fact.entities], CHECK_TOP))
    if fact.embedding and vectors:
        asks.insert(0, lambda s: s.vectors.search(b, fact.embedding, CHECK_TOP))
    out = []
    for ask in asks:
        a, z = [h.id for h in ask(live)], [h.id for h in ask(new)]
        if a or z:
            out.append((a, z))
    return out


def _no_check(banks: list[str]) -> dict:
    """The check's result where there are no search stores to compare (only followers)."""
    return {"banks": len(banks), "units": 0, "recalls": 0, "agreement": 1.0, "moving": 0,
            "gained": 0, "problems": []}


def _close(stores) -> None:
    """Close each of ``stores`` (an iterable of store adapters), logging failures."""
    for s in stores:
        try:
            s.close()
        except Exception:  # keep closing the others
            log.exception("closing a store of a retired generation failed")
