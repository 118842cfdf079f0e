"""search's gRPC servicers: RecallService (Recall, GetMemory, ListMemories),
ObservationService (ListObservationScopes, ListObservations, GetObservation),
EntityService (ListEntities, GetEntity, MergeEntities, SplitEntity), DocumentService (ListDocuments, GetDocument,
ListTags). Where
this process owns its stores it also serves GenerationService
(:mod:`mneme.runtime.generations_api`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

from mneme import apiconv
from mneme.domain import (BUDGETS, DocumentRevision, Filters, RecallOutcome, RecallQuery,
                          StoredDocument, from_epoch)
from mneme.errors import InvalidArgument, NotFound
from mneme.errors import Unavailable
from mneme.grpc_util import call_deadline, dt_to_ts, remaining, translate_errors, ts_to_dt
from mneme.names import (bank_id_of, check_uuid, document_name, entity_name, entity_of,
                         memory_name, memory_of, observation_of, opinion_of, unit_of)
from mneme.ports import DocumentStore, GraphStore, VectorStore
from mneme.v1 import (documents_pb2, documents_pb2_grpc, entities_pb2, entities_pb2_grpc,
                      memory_pb2, observations_pb2, observations_pb2_grpc, opinions_pb2,
                      opinions_pb2_grpc, recall_pb2, recall_pb2_grpc)
from services.search import include, observations, opinions, reads
from services.search.corrections import EntityCorrections

_ARMS = ("semantic", "keyword", "graph", "temporal", "rerank")


def scores_to_api(s) -> recall_pb2.ArmScores:
    kw = {}
    for arm in _ARMS:
        kw[arm] = s.scores.get(arm, 0.0)
        kw[f"{arm}_rank"] = s.ranks.get(arm, 0)
    return recall_pb2.ArmScores(rrf=s.rrf, boost=s.boost, final=s.final, **kw)


#: Recall returns the same facts again and again (see :class:`apiconv.MemoryMessages`).
_MEMORIES = apiconv.MemoryMessages()


def outcome_to_api(o: RecallOutcome) -> recall_pb2.RecallResponse:
    resp = recall_pb2.RecallResponse(total_tokens=o.total_tokens)
    for s in o.results:
        r = resp.results.add(scores=scores_to_api(s), tokens=s.tokens)
        _MEMORIES.fill(r.memory, s.fact)
    if o.time_window:
        resp.query_time_range.CopyFrom(memory_pb2.TimeRange(
            start=dt_to_ts(o.time_window.start), end=dt_to_ts(o.time_window.end)))
    bank_id = o.results[0].fact.bank_id if o.results else ""
    for e in o.entities:
        r = resp.entities.add(entity=entity_name(bank_id, e.ref.id), display_name=e.ref.name,
                              kind=e.ref.label, tokens=e.tokens)
        for f in e.observations:
            _MEMORIES.fill(r.observations.add(), f)
    for d in o.documents:
        resp.documents.add(document=document_name(bank_id, d.document_id),
                           document_id=d.document_id, text=d.text, truncated=d.truncated,
                           tokens=d.tokens, memories=[memory_name(bank_id, i) for i in d.memory_ids])
    return resp


def include_budgets(request) -> dict:
    """RecallRequest.include → RecallQuery's ``include_entities`` / ``include_documents``
    (None when not set, 0 read as the default); recall's ``validate`` refuses a negative
    or too large budget, naming the field."""
    out = {}
    fields = (("entities", "include_entities", include.ENTITY_TOKENS),
              ("documents", "include_documents", include.DOCUMENT_TOKENS))
    if not request.HasField("include"):
        return out
    for name, key, default in fields:
        if request.include.HasField(name):
            out[key] = getattr(request.include, name).max_tokens or default
    return out


class RecallServicer(recall_pb2_grpc.RecallServiceServicer):
    """``recall`` runs a RecallQuery; ``bank_exists`` answers NOT_FOUND for unknown banks;
    ``vectors`` and ``graph`` serve the reads (this and the other servicers of
    :func:`register`); ``corrections`` the entity corrections (None: refused)."""

    def __init__(self, recall: Callable[[RecallQuery], RecallOutcome], vectors: VectorStore,
                 bank_exists: Callable[[str], bool], graph: GraphStore | None = None,
                 corrections: EntityCorrections | None = None,
                 documents: DocumentStore | None = None,
                 documents_current: Callable[[str], bool] = lambda bank_id: True):
        self.recall, self.vectors, self.bank_exists = recall, vectors, bank_exists
        self.graph, self.corrections = graph, corrections
        #: The document projection, and ``documents_current(bank_id)``: wait for it to
        #: hold what ingest acknowledged for the bank (read-your-writes).
        self.documents, self.documents_current = documents, documents_current

    def _bank(self, name: str, field: str = "parent") -> str:
        bank_id = bank_id_of(name, field)
        if not self.bank_exists(bank_id):
            raise NotFound(f"bank {bank_id!r} not found")
        return bank_id

    @translate_errors
    def Recall(self, request, context):
        bank_id = self._bank(request.parent)
        if not request.query.strip():
            raise InvalidArgument("query", "must not be empty")
        if request.max_tokens < 0:
            raise InvalidArgument("max_tokens", "must not be negative")
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        now = ts_to_dt(request.query_timestamp, "query_timestamp") or datetime.now(timezone.utc)
        q = RecallQuery(bank_id=bank_id, query=request.query, query_timestamp=now,
                        filters=apiconv.filters_from_recall(request),
                        budget=apiconv.BUDGET[request.budget], max_tokens=request.max_tokens or 4096,
                        deadline=call_deadline(context), time_zone=request.time_zone.strip(),
                        **include_budgets(request))
        assert q.budget in BUDGETS
        return outcome_to_api(self.recall(q))

    @translate_errors
    def GetMemory(self, request, context):
        bank_id, memory_id, fact_type = unit_of(request.name)
        self._bank(f"banks/{bank_id}", "name")
        return apiconv.memory_to_api(reads.get_memory(self.vectors, bank_id, memory_id,
                                                      fact_type))

    @translate_errors
    def ListMemories(self, request, context):
        bank_id = self._bank(request.parent)
        filters = Filters(types=apiconv.types_from_api(request.types) or observations.DEFAULT_TYPES,
                          document_id=request.document_id)
        facts, token = reads.list_memories(self.vectors, bank_id, request.page_size,
                                           request.page_token, filters)
        return memory_pb2.ListMemoriesResponse(memories=[apiconv.memory_to_api(f) for f in facts],
                                               next_page_token=token)


class ObservationServicer(observations_pb2_grpc.ObservationServiceServicer):
    """Observation reads from the vector store (see :mod:`services.search.observations`)."""

    def __init__(self, recall_servicer: RecallServicer):
        self.rs = recall_servicer

    @translate_errors
    def ListObservationScopes(self, request, context):
        bank_id = self.rs._bank(request.parent)
        scopes, token = observations.list_scopes(self.rs.vectors, bank_id, request.page_size,
                                                 request.page_token)
        return observations_pb2.ListObservationScopesResponse(
            scopes=[observations_pb2.ObservationScope(tags=t, observations=n) for t, n in scopes],
            next_page_token=token)

    @translate_errors
    def ListObservations(self, request, context):
        bank_id = self.rs._bank(request.parent)
        obs, token = observations.list_observations(
            self.rs.vectors, bank_id, request.page_size, request.page_token,
            list(apiconv.check_tags(request.scope, "scope"))
            if request.has_scope or request.scope else None)
        return observations_pb2.ListObservationsResponse(
            observations=[observations.to_api(o) for o in obs], next_page_token=token)

    @translate_errors
    def GetObservation(self, request, context):
        bank_id, observation_id = observation_of(request.name)
        self.rs._bank(f"banks/{bank_id}", "name")
        return observations.to_api(observations.get_observation(self.rs.vectors, bank_id,
                                                                observation_id))


class OpinionServicer(opinions_pb2_grpc.OpinionServiceServicer):
    """Opinion reads from the vector store (see :mod:`services.search.opinions`)."""

    def __init__(self, recall_servicer: RecallServicer):
        self.rs = recall_servicer

    @translate_errors
    def ListOpinions(self, request, context):
        bank_id = self.rs._bank(request.parent)
        if request.entity_id:  # an entity's id (a UUID, as GetEntity names it)
            check_uuid(request.entity_id, "entity_id", "entity id")
        ops, token = opinions.list_opinions(self.rs.vectors, bank_id, request.page_size,
                                            request.page_token, request.entity_id)
        return opinions_pb2.ListOpinionsResponse(
            opinions=[opinions.to_api(o) for o in ops], next_page_token=token)

    @translate_errors
    def GetOpinion(self, request, context):
        bank_id, opinion_id = opinion_of(request.name)
        self.rs._bank(f"banks/{bank_id}", "name")
        return opinions.to_api(opinions.get_opinion(self.rs.vectors, bank_id, opinion_id))


def entity_to_api(bank_id: str, e) -> entities_pb2.Entity:
    """An :class:`mneme.domain.EntityInfo` → Entity (memories and neighbours as names)."""
    return entities_pb2.Entity(
        name=entity_name(bank_id, e.id), id=e.id, display_name=e.name, kind=e.label,
        aliases=list(e.aliases), mention_count=e.mentions,
        first_seen=dt_to_ts(e.first_seen), last_seen=dt_to_ts(e.last_seen),
        memories=[memory_name(bank_id, u) for u in e.units],
        neighbours=[entities_pb2.EntityNeighbour(entity=entity_name(bank_id, i), display_name=n,
                                                 kind=k, shared_memories=c)
                    for i, n, k, c in e.neighbours])


class EntityServicer(entities_pb2_grpc.EntityServiceServicer):
    """Entity reads from the graph store (:mod:`services.search.reads`) and the users'
    corrections (:mod:`services.search.corrections`)."""

    def __init__(self, recall_servicer: RecallServicer):
        self.rs = recall_servicer

    @translate_errors
    def ListEntities(self, request, context):
        bank_id = self.rs._bank(request.parent)
        tags, mode = apiconv.tag_filter(request)
        found, token = reads.list_entities(self.rs.graph, bank_id, request.page_size,
                                           request.page_token, tags, mode)
        return entities_pb2.ListEntitiesResponse(
            entities=[entity_to_api(bank_id, e) for e in found], next_page_token=token)

    @translate_errors
    def GetEntity(self, request, context):
        bank_id, entity_id = entity_of(request.name)
        tags, mode = apiconv.tag_filter(request)
        self.rs._bank(f"banks/{bank_id}", "name")
        return entity_to_api(bank_id, reads.get_entity(self.rs.graph, bank_id, entity_id,
                                                       tags, mode))

    def _corrections(self) -> EntityCorrections:
        if self.rs.corrections is None:
            raise Unavailable("this server does not take entity corrections")
        return self.rs.corrections

    @translate_errors
    def MergeEntities(self, request, context):
        bank_id = bank_id_of(request.parent)
        ids = _entity_ids(bank_id, request.entities, "entities")
        self.rs._bank(request.parent)
        got = self._corrections().merge(self.rs.graph, bank_id, ids, request.display_name,
                                        remaining(context, CORRECTION_TIMEOUT_S))
        return entity_to_api(bank_id, got)

    @translate_errors
    def SplitEntity(self, request, context):
        bank_id, entity_id = entity_of(request.name)
        memories = []
        for i, n in enumerate(request.memories):
            b, m = memory_of(n, f"memories[{i}]")
            if b != bank_id:
                raise InvalidArgument(f"memories[{i}]", f"not a memory of bank {bank_id!r}")
            memories.append((f"memories[{i}]", m))
        self.rs._bank(f"banks/{bank_id}", "name")
        old, new = self._corrections().split(
            self.rs.graph, self.rs.vectors, bank_id, entity_id, list(request.aliases), memories,
            request.display_name, remaining(context, CORRECTION_TIMEOUT_S))
        return entities_pb2.SplitEntityResponse(entity=entity_to_api(bank_id, old),
                                                new_entity=entity_to_api(bank_id, new))


#: Longest wait of a correction for its projection, when the caller set no deadline.
CORRECTION_TIMEOUT_S = 60.0


def _entity_ids(bank_id: str, names, field: str) -> list[str]:
    ids = []
    for i, n in enumerate(names):
        b, e = entity_of(n, f"{field}[{i}]")
        if b != bank_id:
            raise InvalidArgument(f"{field}[{i}]", f"not an entity of bank {bank_id!r}")
        ids.append(e)
    return ids


def revision_to_api(r: DocumentRevision) -> documents_pb2.DocumentRevision:
    """A :class:`mneme.domain.DocumentRevision` → DocumentRevision."""
    return documents_pb2.DocumentRevision(
        revision=r.revision, operation=f"operations/{r.operation_id}",
        retain_time=dt_to_ts(from_epoch(r.at)), item_count=r.items, content_hash=r.content_hash,
        content_chars=r.chars, tags=list(r.tags), context=r.context, text_stored=r.text_stored)


def document_to_api(bank_id: str, document_id: str, d: StoredDocument | None,
                    memory_count: int) -> documents_pb2.Document:
    """The fields of a Document both RPCs fill (text only when ``d`` carries it)."""
    doc = documents_pb2.Document(name=document_name(bank_id, document_id),
                                 document_id=document_id, memory_count=memory_count)
    if d is not None:
        last = d.latest
        doc.create_time.CopyFrom(dt_to_ts(from_epoch(d.created_at)))
        doc.update_time.CopyFrom(dt_to_ts(from_epoch(d.updated_at)))
        doc.text_stored = last.text_stored
        doc.original_text = d.text or ""
        doc.content_hash, doc.content_chars = last.content_hash, last.chars
        doc.tags.extend(last.tags)
        doc.revision_count = d.revisions
    return doc


class DocumentServicer(documents_pb2_grpc.DocumentServiceServicer):
    """Documents from the document projection (text, history) with their memories from
    the vector store, and tags from the vector store (:mod:`services.search.reads`)."""

    def __init__(self, recall_servicer: RecallServicer):
        self.rs = recall_servicer

    def _bank(self, name: str) -> str:
        bank_id = self.rs._bank(name)
        self.rs.documents_current(bank_id)  # then serve what it holds
        return bank_id

    @translate_errors
    def ListDocuments(self, request, context):
        bank_id = self._bank(request.parent)
        docs, token = reads.list_documents(self.rs.documents, self.rs.vectors, bank_id,
                                           request.page_size, request.page_token)
        return documents_pb2.ListDocumentsResponse(documents=[
            document_to_api(bank_id, d.document_id, d, n) for d, n in docs],
            next_page_token=token)

    @translate_errors
    def GetDocument(self, request, context):
        bank_id_of(request.parent)  # a malformed name or an empty id before NOT_FOUND
        if not request.document_id:
            raise InvalidArgument("document_id", "required")
        bank_id = self._bank(request.parent)
        view = reads.get_document(self.rs.documents, self.rs.vectors, bank_id,
                                  request.document_id)
        doc = document_to_api(bank_id, request.document_id, view.stored, view.memory_count)
        doc.memories.extend(apiconv.memory_to_api(f) for f in view.facts)
        doc.chunk_ids.extend(dict.fromkeys(f.chunk_id for f in view.facts if f.chunk_id))
        doc.history.extend(revision_to_api(r) for r in view.history)
        times = [f.mentioned_at for f in view.facts if f.mentioned_at]
        if view.stored is None and times:  # the projection has not reached it yet
            doc.update_time.CopyFrom(dt_to_ts(max(times)))
        return doc

    @translate_errors
    def ListTags(self, request, context):
        bank_id = self.rs._bank(request.parent)
        tags, token = reads.list_tags(self.rs.vectors, bank_id, request.page_size,
                                      request.page_token)
        return documents_pb2.ListTagsResponse(
            tags=[documents_pb2.Tag(tag=t, memory_count=n) for t, n in tags],
            next_page_token=token)


def register(server, servicer: RecallServicer) -> list[str]:
    recall_pb2_grpc.add_RecallServiceServicer_to_server(servicer, server)
    observations_pb2_grpc.add_ObservationServiceServicer_to_server(
        ObservationServicer(servicer), server)
    entities_pb2_grpc.add_EntityServiceServicer_to_server(EntityServicer(servicer), server)
    documents_pb2_grpc.add_DocumentServiceServicer_to_server(DocumentServicer(servicer), server)
    opinions_pb2_grpc.add_OpinionServiceServicer_to_server(OpinionServicer(servicer), server)
    return [opinions_pb2.DESCRIPTOR.services_by_name["OpinionService"].full_name,
            recall_pb2.DESCRIPTOR.services_by_name["RecallService"].full_name,
            observations_pb2.DESCRIPTOR.services_by_name["ObservationService"].full_name,
            entities_pb2.DESCRIPTOR.services_by_name["EntityService"].full_name,
            documents_pb2.DESCRIPTOR.services_by_name["DocumentService"].full_name]
