"""Replay: rebuild projections from the event log (``mneme replay``)."""

from __future__ import annotations

from mneme.bootstrap import Root, build_consolidation, build_ingest, build_search
from mneme.config import Settings
from mneme.generations import remove_local
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


def replay(settings: Settings | None = None, progress=None, force: bool = False
           ) -> dict[str, int]:
    """Rebuild projections from the log; no model is called (derived events carry the
    facts and embeddings) and nothing is appended (the progress events the projections
    would emit are already on the log). ``progress(done, total)`` is called as records
    are consumed. Returns {"records": n, "generation": the live store generation}. The
    groups replayed are those the routes mark :attr:`~mneme.router.Group.replay` among
    the services whose state this process holds:

    * search's stores are rebuilt into a new generation up to the search group's
      committed offsets, checked against the live generation and switched to
      (:class:`mneme.runtime.live_replay.LiveReplay`; ``force``: switch despite the
      check), then brought to the end of the log. A failed or refused replay raises
      :class:`ReplayFailed` and leaves the live generation, the catalog and every
      group's offsets as they were.
    * The other replayed groups' state is rebuilt in place from offset 0: embedded (sqlite
      bus), the catalog and consolidation's observation projection of the (stopped)
      server's data dir (consolidation: recorded decisions only); distributed (kafka
      bus), search's bank catalog. Raises DataDirLocked while a server uses the data
      directory (a running server replays its stores itself: ``mneme replay
      --address``).
    * Distributed, the groups are read outside the consumer group. With local store files
      they are one replica's own copies (its data dir, its own consumer groups). With
      store servers the ``search`` group is shared: stop every search process first;
      while the group has live members Kafka refuses, and replay raises StaleCommitError
      before it changes anything."""
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
        search = next(p for p in parts if p.name == "search")
        gen = search.api["replay"].run(force=force, progress=progress)
        if gen.state != "LIVE":
            raise ReplayFailed(gen)
        for p in parts:
            if "observations" in p.api:
                p.api["observations"].reset()
        root.catalog.reset()
        total = 0
        for name, r in routers.items():
            if name != "search":  # search goes on from its offsets, into the new generation
                root.log.reset_group(r.group_id, r.topics)
            total += sum(root.log.end_offset(*tp) - root.log.committed(r.group_id, *tp)
                         for tp in tps[name])
        done = _drain(LogRunner(root.log, routers), progress, total)
        if progress:
            progress(total, total)
        return {"records": gen.records_done + done, "generation": gen.generation}
    finally:
        root.close()


class ReplayFailed(RuntimeError):
    """A replay that did not switch; ``generation`` is its FAILED record (its ``error``
    says why, e.g. the check's differences)."""

    def __init__(self, generation) -> None:
        self.generation = generation
        super().__init__(f"replay into generation {generation.generation} failed; the live "
                         f"generation is unchanged: {generation.error}")


def drop_generation(settings: Settings | None, generation: int) -> None:
    """Delete a RETIRED or FAILED generation of a stopped server's data dir (its store
    files, or its server collections emptied, and its record). KeyError when unknown,
    ValueError for the live one, DataDirLocked while a server runs (drop through it:
    ``mneme generations drop N --address``)."""
    root = Root(settings)
    try:
        rec = root.generations.get(generation)
        if rec is None:
            raise KeyError(generation)
        if rec.state == "LIVE":
            raise ValueError(f"generation {generation} is live")
        remove_local(root.store_urls(generation))
        root.generations.forget(generation)
    finally:
        root.close()
