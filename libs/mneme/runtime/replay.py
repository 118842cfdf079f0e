"""Replay: rebuild projections from the event log (``mneme replay``)."""

from __future__ import annotations

from mneme.bootstrap import Root, build_consolidation, build_ingest, build_search
from mneme.config import Settings
from mneme.runtime.log_runner import LogRunner


def _drain(runner: LogRunner, progress, total: int) -> int:
    """Run every group of ``runner`` in this thread, projecting only (their outputs are
    already on the log), until each has consumed its partitions to the end."""
    done = 0
    for c in runner.consumers.values():
        c.produce = False  # not even a dead letter: a failed replay appends nothing
        while True:
            n = c.run_once()
            done += n
            if progress and n:
                progress(done, max(total, done))
            if n == 0 and c.wait_idle(0.2):  # Kafka: a fetch may return early empty
                break
    return done


def replay(settings: Settings | None = None, progress=None, force: bool = False,
           reembedding: bool = False) -> dict[str, int]:
    """Rebuild projections from the log; no model is called (derived events carry the
    facts and embeddings) and nothing is appended (the progress events the projections
    would emit are already on the log). ``progress(done, total)`` is called as records
    are consumed. Returns {"records": n, "generation": g, "state": LIVE | READY}. The
    groups replayed are those the routes mark :attr:`~mneme.router.Group.replay` among
    the services whose state this process holds:

    * search's stores are rebuilt into a new generation up to the search group's
      committed offsets and checked against the live generation
      (:class:`mneme.runtime.live_replay.LiveReplay`; ``force``: despite the check). A
      failed or refused replay raises :class:`ReplayFailed` and leaves the live
      generation, the catalog and every group's offsets as they were.
    * Stores of this data dir (embedded, or a search replica's local files; its server
      stopped, else DataDirLocked: a running server replays itself, ``mneme replay
      --address``): the new generation is switched to (embedded, consolidation's
      observation projection is part of it: recorded decisions only, up to its group's
      offsets) and search's stores are brought to the end of the log; then the catalog
      (embedded: ingest's; distributed: search's bank catalog) and search's document
      projection are rebuilt in place from offset 0, and embedded, extraction's entity
      resolver (:func:`rebuild_resolver`). Those groups are read outside their consumer
      group; Kafka refuses (StaleCommitError, before anything changes) while one has
      live members.
    * Store servers the search replicas share (distributed): the replicas keep serving.
      This process's bank catalog is rebuilt first (the check's bank list), then the
      generation after ``MNEME_STORE_GENERATION`` is built under the consumer group it
      will run under and left READY; the replicas switch to it when they are configured
      with it (their group goes on from where the replay stopped).

    ``reembedding`` (:func:`mneme.runtime.reembed.reembed`): the live generation may hold
    another model's vectors than ``MNEME_EMBEDDING_MODEL``, the new one's; the switch
    records the new model (:attr:`mneme.generations.Generation.embedding_model`)."""
    root = Root(settings, reembedding=reembedding, rebuilding=True)
    try:
        if root.distributed:
            parts = [build_search(root)]
        else:
            parts = [build_ingest(root), build_search(root, bank_exists=lambda b: True),
                     build_consolidation(root, decide=False)]
            # consolidation's projection is rebuilt into the new generation with search's
            parts[1].api["replay"].followers.append(parts[2].api["follower"])
        routers = {g: r for p in parts for g, r in p.routers.items() if r.group.replay}
        tps = {g: [(t, p) for t in r.topics for p in range(root.log.partitions(t))]
               for g, r in routers.items()}
        live_replay = next(p for p in parts if p.name == "search").api["replay"]
        if live_replay.shared:  # the replicas go on serving the live generation meanwhile
            routers.pop("search")
        # Refuse before anything is wiped: committing each group's own offsets back is a
        # no-op, which Kafka refuses (StaleCommitError) while the group has live members.
        for g, r in routers.items():
            gid = r.group_id
            root.log.commit(gid, {tp: root.log.committed(gid, *tp) for tp in tps[g]})
        if live_replay.shared:  # this process's bank catalog first: the check's bank list
            _rebuild(root, parts, routers, tps, progress)
        gen = live_replay.run(force=force, progress=progress)
        if gen.state not in ("LIVE", "READY"):
            raise ReplayFailed(gen)
        if live_replay.shared:
            return {"records": gen.records_done, "generation": gen.generation,
                    "state": gen.state}
        done = _rebuild(root, parts, routers, tps, progress)
        # distributed, extraction's replicas restore theirs on assignment
        resolved = 0 if root.distributed else rebuild_resolver(root)
        return {"records": gen.records_done + done + resolved, "generation": gen.generation,
                "state": gen.state, "generation_records": gen.records_done,
                "catalog_records": done, "resolver_records": resolved}
    finally:
        root.close()


def _rebuild(root: Root, parts, routers: dict, tps: dict, progress) -> int:
    """Rebuild the state of ``routers`` from offset 0 in place (the catalog), except the
    projections of the generation just switched to (search's stores and consolidation's
    observation projection), which go on from their groups' offsets; returns the records
    consumed."""
    routers = {n: r for n, r in routers.items() if n != "consolidation"}
    # Offsets first: a process stopped between the two steps leaves a full catalog that
    # its groups project again from 0 (idempotent upserts), never an empty one whose
    # groups think it is current.
    for name, r in routers.items():
        if name != "search":
            root.log.reset_group(r.group_id, r.topics)
    root.catalog.reset()
    if "search-documents" in routers:  # search's document projection, rebuilt likewise
        root.documents.reset()
    total = 0
    for name, r in routers.items():
        total += sum(root.log.end_offset(*tp) - root.log.committed(r.group_id, *tp)
                     for tp in tps[name])
    done = _drain(LogRunner(root.log, routers), progress, total)
    if progress:
        progress(total, total)
    return done


def rebuild_resolver(root: Root) -> int:
    """Rebuild extraction's entity resolver (``<data_dir>/entities.db``, embedded) from
    ``mneme.memory.v1``, as a distributed replica restores it on assignment: extraction's
    restore routes (:attr:`mneme.router.Group.restore`) applied to every record, from
    offset 0 to the end -- the resolutions (``EntitiesResolved``), which content names
    which entity (``FactsExtracted``), the users' corrections (``EntitiesMerged``,
    ``EntitySplit``) and what deletions forgot (``FactsRetracted``). Without it a data
    dir rebuilt from the log resolved later mentions against no state at all: a merged
    name became a new entity again. Built into a file of its own that then replaces the
    old one (a replay stopped halfway leaves the old file). Returns the records applied.
    The server must be stopped (the caller holds the data dir)."""
    import sqlite3

    from mneme.bootstrap import services
    from mneme.bus import MEMORY
    from mneme.bus.codec import decode
    from mneme.router import Router
    from mneme.stores.entities_sqlite import SqliteEntityStore
    from services.extraction.resolver import EntityResolver

    live = root.data_dir / "entities.db"
    new = root.data_dir / "entities.db.rebuild"
    for f in (new, new.with_name(new.name + "-wal"), new.with_name(new.name + "-shm")):
        f.unlink(missing_ok=True)
    resolver = EntityResolver(SqliteEntityStore(str(new)))
    applied = 0
    try:
        # the intake routes restore a replica's own bank catalog: embedded, ingest's
        # catalog is the one, rebuilt already
        router = Router(services()["extraction"], "extraction",
                        {"resolver": resolver, "catalog": root.catalog,
                         "keyring": root.keyring}, restore=True)
        for p in range(root.log.partitions(MEMORY)):
            off, end = 0, root.log.end_offset(MEMORY, p)
            while off < end:
                batch = root.log.read(MEMORY, p, off, limit=500)
                if not batch:
                    break
                for rec in batch:
                    if rec.headers.get("ce_type") not in router.types:
                        continue  # not part of this state: no decode
                    try:
                        env = decode(rec)
                    except Exception:  # noqa: BLE001 - a poison record: dead-lettered live
                        continue
                    router(env, rec)
                    applied += 1
                off = batch[-1].offset + 1
    finally:
        resolver.close()
    if live.exists():  # its WAL into it first: nothing of it is lost if we stop here
        try:
            db = sqlite3.connect(str(live))
            try:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                db.close()
        except sqlite3.DatabaseError:  # damaged: replaced whole below
            pass
    for suffix in ("-wal", "-shm"):
        live.with_name(live.name + suffix).unlink(missing_ok=True)
    new.replace(live)
    return applied


class ReplayFailed(RuntimeError):
    """A replay that did not switch; ``generation`` is its FAILED record (its ``error``
    says why, e.g. the check's differences)."""

    def __init__(self, generation) -> None:
        self.generation = generation
        super().__init__(f"replay into generation {generation.generation} failed; the live "
                         f"generation is unchanged: {generation.error}")


def drop_generation(settings: Settings | None, generation: int) -> None:
    """Delete a generation of search's stores that is not live, with the server stopped
    (local files; on store servers its collection, index and graph: any number but
    ``MNEME_STORE_GENERATION``). KeyError when the data dir knows no such generation,
    ValueError for the live one, DataDirLocked while a server runs (drop through it:
    ``mneme generations drop N --address``)."""
    from types import SimpleNamespace

    from mneme.bootstrap import adopt_observations_file, observations_file, services
    from mneme.runtime.live_replay import LiveReplay
    root = Root(settings)
    try:  # the search group's name is all a drop needs of it: the live stores stay shut
        live = SimpleNamespace(group=services()["search"].group("search"))
        # embedded, consolidation's projection is part of each generation: its file too
        # (an observations.db from before it had generations is the live one's)
        followers = []
        if not root.distributed:
            adopt_observations_file(root.data_dir, root.generations.live())
            followers = [SimpleNamespace(path=lambda g: observations_file(root.data_dir, g))]
        LiveReplay(root, live, make_router=None, followers=followers).drop(generation)
    finally:
        root.close()
