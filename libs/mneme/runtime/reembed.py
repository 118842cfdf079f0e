"""Re-embed a data dir with another embedding model (``mneme reembed``), event-sourced.

A model change cannot be a replay: events carry their vectors, and replay calls no
model. So a re-embed is an operation with its own events, in three steps, with the
server stopped (the data dir is locked):

1. Under the data dir's model (:meth:`mneme.bootstrap.Root.stored_embedding_model`),
   every unit of every bank in the live generation (facts, observations, opinions) is
   embedded with the new model and appended as
   :class:`~mneme.events.v1.events_pb2.VectorsReplaced` events (at most
   :data:`services.extraction.reembed.BATCH` units each), sealed like the units' text.
   Search's and consolidation's groups then read them under the old model, which ignores
   another model's vectors (nothing changes for a server under the old model).
2. A replay under the new model (:func:`mneme.runtime.replay.replay`) builds a new
   generation: the events before the re-embed bring the old vectors, its VectorsReplaced
   replace them (:meth:`services.search.handlers.Projections.building`); the check
   compares units per bank, the text and graph answers (the two generations' vectors
   are of two models: their kNN is not compared) and that no bank is left with the old
   model's vectors; then switches.
3. The switch records the new model on the generation (the data dir's model from then
   on, in the same write); ``<data_dir>/embedding_model`` follows.

A re-embed that fails or is interrupted at any step leaves the live generation and the
data dir's model as they were: the server runs under the old model (the VectorsReplaced
already appended are ignored by it). Running it again is safe: it re-embeds the units
held then, and a unit's VectorsReplaced applied twice changes nothing.

Embedded data dirs (or a search replica's own store files) only: with store servers the
search replicas share, or a Kafka log, the re-embed is refused (:class:`ReembedRefused`).
"""

from __future__ import annotations

import logging
from typing import Callable

from mneme.bank_catalog import bank_ids
from mneme.bus import MEMORY, codec
from mneme.config import Settings
from mneme.domain import derive_id

log = logging.getLogger("mneme")

#: The event types the re-embed lets search's and consolidation's groups have unread on
#: ``mneme.memory.v1`` (those of an interrupted re-embed); anything else must be
#: projected first (its units would not be re-embedded).
_MAY_LAG = (codec.TYPE_PREFIX + "VectorsReplaced",)
#: The groups whose projections hold vectors (or the units a re-embed reads).
_GROUPS = ("search", "consolidation")


class ReembedRefused(RuntimeError):
    """The data dir cannot be re-embedded as it is (the message says why and what to
    do); nothing was changed."""


def reembed(settings: Settings | None, model: str,
            progress: Callable[[str, int, int], None] | None = None,
            force: bool = False) -> dict:
    """Re-embed the data dir of ``settings`` with ``model`` (a name of
    :data:`mneme.embedding.MODELS`). ``progress(stage, done, total)``: stage "embedding"
    (units) then "replaying" (records). ``force``: switch even when the replay's check
    finds differences (see ``mneme replay --force``).

    Returns {"previous_model", "model", "banks", "units", "events", "records",
    "generation", "state"} ("state" "UNCHANGED" when the data dir already holds
    ``model``'s vectors or none at all, whose model is then recorded).

    Raises ValueError for an unknown model (naming the choices); :class:`ReembedRefused`
    (distributed topology, shared store servers, unprojected records);
    :class:`mneme.datadir.DataDirLocked` while a server runs;
    :class:`mneme.runtime.replay.ReplayFailed` when the new generation fails its check.
    Whatever fails, the data dir stays servable under its previous model."""
    from mneme.bootstrap import Root
    from mneme.datadir import write_atomic
    from mneme.embedding import packaged_model
    from mneme.runtime.replay import replay

    target = packaged_model(model).name  # ValueError naming the choices
    settings = settings or Settings()
    root = Root(settings)
    try:
        if root.distributed or not root.owns_stores:
            raise ReembedRefused(
                "mneme reembed runs on a data dir whose stores it owns (embedded, "
                "MNEME_BUS_URL=sqlite:…); with a Kafka log and shared store servers, "
                "re-embedding is not supported yet (the replicas would switch models one "
                "by one)")
        previous = root.stored_embedding_model()
    finally:
        root.close()
    out = {"previous_model": previous, "model": target, "banks": 0, "units": 0,
           "events": 0, "records": 0, "generation": 0, "state": "UNCHANGED"}
    mark = settings.data_dir.resolve() / "embedding_model"
    if not previous or previous == target:  # nothing of another model to re-embed
        if not previous:
            write_atomic(mark, target + "\n")
        return out
    packaged_model(previous)  # the old stores' dimension comes from it

    # 1: the new vectors onto the log, under the old model
    old = Root(settings.model_copy(update={"embedding_model": previous}))
    try:
        _check_projected(old)
        out.update(_append_vectors(old, target, previous, progress))
        _pass_over(old)
    finally:
        old.close()

    # 2, 3: a new generation under the new model, checked, switched
    new_settings = settings.model_copy(update={"embedding_model": target})
    stats = replay(new_settings, (lambda d, t: progress("replaying", d, t)) if progress
                   else None, force=force, reembedding=True)
    write_atomic(mark, target + "\n")
    out.update(records=stats["records"], generation=stats["generation"], state=stats["state"])
    log.info("reembed: %d units of %d banks re-embedded with %s (was %s); generation %d "
             "is live", out["units"], out["banks"], target, previous, out["generation"])
    return out


def _check_projected(root) -> None:
    """ReembedRefused when search's or consolidation's group has records of
    ``mneme.memory.v1`` it has not handled (other than an interrupted re-embed's): their
    units are not in the stores yet, so they would not be re-embedded."""
    from mneme.bootstrap import services
    log_ = root.raw_log
    for name in _GROUPS:
        gid = root.group_id(services()[name].group(name))
        pending = 0
        for p in range(log_.partitions(MEMORY)):
            offset, end = log_.committed(gid, MEMORY, p), log_.end_offset(MEMORY, p)
            while offset < end:
                batch = log_.read(MEMORY, p, offset, min(500, end - offset))
                if not batch:
                    break
                pending += sum(r.headers.get("ce_type") not in _MAY_LAG for r in batch)
                offset = batch[-1].offset + 1
        if pending:
            raise ReembedRefused(
                f"{name} has {pending} record(s) of {MEMORY} not handled yet: start the "
                f"server under its model (MNEME_EMBEDDING_MODEL="
                f"{root.settings.embedding_model}) until it has caught up (`mneme banks "
                "stats BANK`: no pending records), stop it, then re-embed")


def _append_vectors(root, target: str, previous: str, progress) -> dict:
    """Embed every unit of every bank of ``root``'s live stores with ``target`` and append
    the VectorsReplaced events (a bank with no unit gets one empty event: its vectors
    are ``target``'s from there on). Returns {"banks", "units", "events"}."""
    from mneme.bootstrap import build_extraction, services
    from mneme.embedding import default_embedder
    from services.extraction.reembed import BATCH, reembed_batch

    embedder = default_embedder(target)
    extractor = build_extraction(root).api["extractor"]
    vectors = root.stores.vectors
    source = services()["extraction"].source  # its policy; it declares the event type
    banks = bank_ids(root.catalog)
    total = sum(vectors.count(b) for b in banks)
    done = events = 0
    if progress:
        progress("embedding", 0, total)
    for bank in banks:
        n = vectors.count(bank)
        batches = max(1, -(-n // BATCH))
        after, k = None, 0
        while True:
            page, after = vectors.scroll(bank, BATCH, after) if n else ([], None)
            msg = reembed_batch(bank, page, embedder, previous, k, batches, extractor,
                                context=lambda ids, b=bank: vectors.get(b, ids))
            # the same id for the same batch of the same re-embed: a re-run's events
            # are recognisable as repeats (each is idempotent anyway)
            eid = derive_id("reembed", bank, previous, target, k, page[0].id if page else "")
            root.log.append([codec.encode(msg, bank_id=bank, source=source, event_id=eid)])
            events += 1
            k += 1
            done += len(page)
            if progress:
                progress("embedding", done, max(total, done))
            if after is None:
                break
    return {"banks": len(banks), "units": done, "events": events}


def _pass_over(root) -> None:
    """Let search's and consolidation's groups read the appended events under the old
    model (they ignore another model's vectors), so the replay that follows, which
    replays up to where they are, reads them too. Only the re-embed's records are
    unread (:func:`_check_projected`); nothing is decided or appended."""
    from mneme.bootstrap import build_consolidation, build_search
    from mneme.runtime.log_runner import LogRunner
    from mneme.runtime.replay import _drain
    parts = [build_search(root, bank_exists=lambda b: True),
             build_consolidation(root, decide=False)]
    routers = {g: r for p in parts for g, r in p.routers.items() if g in _GROUPS}
    _drain(LogRunner(root.log, routers), None, 0)


__all__ = ["ReembedRefused", "reembed"]
