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


def replay(settings: Settings | None = None, progress=None) -> dict[str, int]:
    """Rebuild projections from the log; no model is called (derived events carry the
    facts and embeddings) and nothing is appended (the progress events the projections
    would emit are already on the log). ``progress(done, total)`` is called as records
    are consumed. Returns {"records": n}. The groups replayed are those the routes mark
    :attr:`~mneme.router.Group.replay` among the services whose state this process holds:

    * Embedded (sqlite bus): the search stores (observations included), the catalog and
      consolidation's observation projection of the (stopped) server's data dir
      (consolidation: recorded decisions only). Raises DataDirLocked while a server uses
      the data directory.
    * Distributed (kafka bus): the search service's projections (the stores its
      ``MNEME_*_URL``s name) and its bank catalog, reset to offset 0 and read outside the
      consumer group. With local store files these are one replica's own copies (its data
      dir, its own consumer groups): stop that replica first, or the data dir's lock
      refuses (DataDirLocked). With store servers the ``search`` group is shared: stop
      every search process first; while the group has live members Kafka refuses, and
      replay raises StaleCommitError before it changes anything."""
    root = Root(settings)
    try:
        if root.distributed:
            parts = [build_search(root)]
        else:
            parts = [build_ingest(root), build_search(root, bank_exists=lambda b: True),
                     build_consolidation(root, decide=False)]
        routers = {g: r for p in parts for g, r in p.routers.items() if r.group.replay}
        tps = {g: [(t, p) for t in r.topics for p in range(root.log.partitions(t))]
               for g, r in routers.items()}
        # Refuse before anything is wiped: committing each group's own offsets back is a
        # no-op, which Kafka refuses (StaleCommitError) while the group has live members.
        for g, r in routers.items():
            gid = r.group_id
            root.log.commit(gid, {tp: root.log.committed(gid, *tp) for tp in tps[g]})
        for p in parts:
            if "observations" in p.api:
                p.api["observations"].reset()
        root.stores.reset()
        root.catalog.reset()
        total = 0
        for name, r in routers.items():
            root.log.reset_group(r.group_id, r.topics)
            total += sum(root.log.end_offset(*tp) for tp in tps[name])
        done = _drain(LogRunner(root.log, routers), progress, total)
        if progress:
            progress(total, total)
        return {"records": done}
    finally:
        root.close()
