"""Bank statistics (``BankService.GetBankStats``, ``mneme banks stats BANK``) and profile
(``GetBankProfile``: the statistics plus documents, directives, mental models and the
latest activity).

* facts, observations, entities: counted in search's projections when this process has
  them (the embedded topology); -1 when it does not (the distributed ingest process holds
  only the catalog: ask the embedded server, or read the stores directly) or when the
  store does not answer (the rest, the lag above all, is still answered).
  The stores keep these counts as they write (the vector store by fact type, the
  embedded graph store its entities), so the call costs about the same at any bank size;
  a store with no current count of the bank (after a crash; a graph other processes
  write) counts it once.
* pending work: the operations of the bank not yet terminal (catalog), and the records
  every consumer group has not yet committed on the bank's partition of its topics
  (events are keyed by bank, so one partition holds all of a bank's events; other banks
  sharing the partition count too, so it is an upper bound).
"""

from __future__ import annotations

import logging

from mneme.bus import partition_for

_log = logging.getLogger("mneme")


def _count_observations(vectors, bank_id: str) -> int:
    """Observations in the vector store (units with fact_type ``observation``, see
    ``services.search.observations``), counted by the store."""
    from mneme.domain import Filters
    return int(vectors.count(bank_id, Filters(types=("observation",))))


def consumer_lag(log, bank_id: str, groups) -> list[tuple[str, str, int, int]]:
    """(group, topic, partition, records not yet committed) on the bank's partition of
    each topic the group follows. Groups that never committed count from offset 0."""
    out = []
    for group, topics in groups.items():
        for topic in topics:
            p = partition_for(bank_id, log.partitions(topic))
            lag = max(0, log.end_offset(topic, p) - log.committed(group, topic, p))
            out.append((group, topic, p, lag))
    return out


def _unless_away(count) -> int:
    """``count()``, or -1 (unknown) when its store server does not answer
    (:func:`mneme.errors.store_unavailable`): the statistics still answer with the rest,
    the consumer lag above all, which shows the work that store holds back."""
    from mneme.errors import store_unavailable
    try:
        return count()
    except Exception as e:
        if store_unavailable(e) is None:
            raise
        _log.warning("bank statistics: a store does not answer (%s); its count is unknown",
                    store_unavailable(e))
        return -1


def bank_stats(bank_id: str, *, log, catalog, groups, stores=None) -> dict:
    """The bank's statistics as a dict (see the module docstring). ``groups`` (group →
    topics, :func:`mneme.router.groups_of` the services' routes) are the consumer groups
    whose lag counts: those that run in the topology."""
    stats = {"facts": -1, "observations": -1, "entities": -1}
    if stores is not None:
        # the vector store holds observations and opinions too: count the facts' types
        from mneme.domain import FACT_TYPES, Filters
        stats["observations"] = _unless_away(lambda: _count_observations(stores.vectors,
                                                                          bank_id))
        stats["facts"] = _unless_away(
            lambda: int(stores.vectors.count(bank_id, Filters(types=FACT_TYPES))))
        stats["entities"] = _unless_away(lambda: stores.graph.count_entities(bank_id))
    stats["operations"], stats["pending_operations"] = catalog.count_operations(bank_id)
    stats["lag"] = consumer_lag(log, bank_id, groups)
    return stats


#: Most distinct documents, directives or mental models a profile counts (beyond it the
#: count stops there).
PROFILE_COUNT_MAX = 100_000


def bank_profile(bank, *, catalog, stores=None, documents=None) -> dict:
    """``{"documents", "directives", "mental_models", "last_activity"}`` of ``bank`` (a
    :class:`mneme.domain.Bank`): documents counted by search's document projection
    (``documents``, a :class:`mneme.ports.DocumentStore`: those ListDocuments lists), else
    by the vector store's keyword index (documents with memories), else -1; directives and mental models by the catalog (at most
    :data:`PROFILE_COUNT_MAX` each), the latest activity (epoch seconds) the later of the
    bank's update and its newest operation's."""
    from mneme.domain import Filters
    projection, documents = documents, -1
    if projection is not None:
        documents = projection.count(bank.bank_id)
    elif stores is not None:
        documents = len(stores.vectors.facet(bank.bank_id, "document_id", PROFILE_COUNT_MAX,
                                             Filters(types=("world", "experience"))))
    newest = catalog.list_operations(bank.bank_id, 1)
    last = max([bank.updated_at.timestamp() if bank.updated_at else 0.0]
               + [op.updated_at for op in newest])
    return {"documents": documents,
            "directives": len(catalog.list_directives(bank.bank_id, PROFILE_COUNT_MAX)),
            "mental_models": len(catalog.list_mental_models(bank.bank_id, PROFILE_COUNT_MAX)),
            "last_activity": last}
