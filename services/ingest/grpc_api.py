"""ingest's gRPC servicers: BankService, DirectiveService, MemoryService (writes),
OperationService, and KeyService (the data keys of the history, for external consumers of the log). They
translate messages and call :class:`services.ingest.handlers.Ingest`."""

from __future__ import annotations

from datetime import datetime, timezone

from google.protobuf import empty_pb2

from mneme import apiconv, auth, limits, paging
from mneme.errors import InvalidArgument, NotFound
from mneme.grpc_util import dt_to_ts, remaining, translate_errors
from mneme.aipfilter import parse_equalities
from mneme.domain import (DIRECTIVE_FIELDS, OPERATION_KINDS, OPERATION_STATES, Directive,
                          from_epoch)
from mneme.names import (bank_id_of, directive_name, directive_of, memory_of, operation_of,
                         opinion_of, unit_of)
from mneme.v1 import banks_pb2, banks_pb2_grpc, keys_pb2, keys_pb2_grpc, memory_pb2
from mneme.v1 import directives_pb2, directives_pb2_grpc
from mneme.v1 import memory_pb2_grpc
from mneme.v1 import operations_pb2, operations_pb2_grpc
from services.ingest.handlers import Ingest


def _bank_fields(request) -> tuple:
    """(bank_id, display_name, BankConfig) of an Upsert/UpdateBankRequest's ``bank``."""
    if not request.HasField("bank"):
        raise InvalidArgument("bank", "required")
    return (bank_id_of(request.bank.name, "bank.name"), request.bank.display_name,
            apiconv.bank_config_from_api(request.bank.config))


class BankServicer(banks_pb2_grpc.BankServiceServicer):
    def __init__(self, ingest: Ingest):
        self.ingest = ingest

    @translate_errors
    def UpsertBank(self, request, context):
        bank = self.ingest.upsert_bank(*_bank_fields(request), timeout=remaining(context, 30.0))
        return apiconv.bank_to_api(bank)

    @translate_errors
    def UpdateBank(self, request, context):
        bank = self.ingest.update_bank(*_bank_fields(request),
                                       list(request.update_mask.paths)
                                       or apiconv.bank_paths_populated(request.bank),
                                       timeout=remaining(context, 30.0))
        return apiconv.bank_to_api(bank)

    @translate_errors
    def GetBank(self, request, context):
        return apiconv.bank_to_api(self.ingest.require_bank(bank_id_of(request.name, "name")))

    @translate_errors
    def ListBanks(self, request, context):
        size = paging.page_size(request.page_size)
        after = paging.decode_token(request.page_token, "banks") or ""
        self.ingest.catch_up(None)
        banks = self.ingest.catalog.list_banks(size + 1, after)
        more = len(banks) > size
        banks = banks[:size]
        return banks_pb2.ListBanksResponse(
            banks=[apiconv.bank_to_api(b) for b in banks],
            next_page_token=paging.encode_token("banks", banks[-1].bank_id) if more else "")

    @translate_errors
    def DeleteBank(self, request, context):
        self.ingest.delete_bank(bank_id_of(request.name, "name"), timeout=remaining(context, 30.0))
        return empty_pb2.Empty()


    @translate_errors
    def CheckLlm(self, request, context):
        extraction, checks = self.ingest.check_llm(bank_id_of(request.name, "name"))
        return banks_pb2.CheckLlmResponse(extraction=extraction, checks=[
            banks_pb2.CheckLlmResponse.Check(operation=c.operation, model=c.model, ok=c.ok,
                                             latency_s=c.latency_s, error=c.error)
            for c in checks])

    @translate_errors
    def GetBankStats(self, request, context):
        bank_id = bank_id_of(request.name, "name")
        self.ingest.require_bank(bank_id)  # NOT_FOUND for an unknown bank
        return self._stats(bank_id)

    @translate_errors
    def GetBankProfile(self, request, context):
        from services.ingest.stats import bank_profile
        bank_id = bank_id_of(request.name, "name")
        bank = self.ingest.require_bank(bank_id)
        p = bank_profile(bank, catalog=self.ingest.catalog, stores=self.ingest.stores,
                         documents=self.ingest.documents)
        out = banks_pb2.BankProfile(bank=apiconv.bank_to_api(bank), stats=self._stats(bank_id),
                                    documents=p["documents"], directives=p["directives"],
                                    mental_models=p["mental_models"])
        out.last_activity_time.CopyFrom(dt_to_ts(from_epoch(p["last_activity"])))
        return out

    def _stats(self, bank_id: str) -> banks_pb2.BankStats:
        from services.ingest.stats import bank_stats
        st = bank_stats(bank_id, log=self.ingest.log, catalog=self.ingest.catalog,
                        stores=self.ingest.stores, groups=self.ingest.groups())
        lag = [banks_pb2.ConsumerLag(group=g, topic=t, partition=p, lag=n)
               for g, t, p, n in st["lag"]]
        pending = sum(x.lag for x in lag)
        if auth.current().banks is not None:
            # the bank's partitions hold other banks' records too: their lag would let a
            # tenant's key watch other tenants' write volume
            lag, pending = [], -1
        return banks_pb2.BankStats(
            name=f"banks/{bank_id}", facts=st["facts"], observations=st["observations"],
            entities=st["entities"], pending_operations=st["pending_operations"],
            operations=st["operations"], lag=lag, pending_records=pending)


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self, ingest: Ingest):
        self.ingest = ingest

    @translate_errors
    def Retain(self, request, context):
        # The limits, checked here rather than by the interceptor (limits.PER_ITEM): items
        # over a limit fail alone, the rest of the request must be valid.
        invalid, rejected = limits.split_items(limits.check(request))
        if invalid:
            raise InvalidArgument(*invalid[0], *invalid[1:])
        bank_id = bank_id_of(request.parent)
        items = apiconv.retain_items_from_api(request.items, datetime.now(timezone.utc))
        scopes = (apiconv.observation_scopes_from_api(request.observation_scopes)
                  if request.HasField("observation_scopes") else None)
        if scopes is not None and scopes.mode == "combined":
            # one scope of every item's tags: a scope is bounded like an item's tags
            union = {t for n, i in enumerate(items) if n not in rejected for t in i.tags}
            bound = limits.limits().tags
            if len(union) > bound:
                raise InvalidArgument("observation_scopes.mode", f"COMBINED makes one scope "
                                      f"of the items' {len(union)} distinct tags; a scope "
                                      f"holds at most {bound}")
        if scopes is not None and scopes.mode in ("explicit", "per_tag"):
            # one request must not buy minutes of consolidation: each fact is worked into
            # each of its scopes
            kept = [i for n, i in enumerate(items) if n not in rejected]
            n = (len(kept) * len({tuple(sorted(set(s.tags))) for s in scopes.scopes})
                 if scopes.mode == "explicit" else sum(len(set(i.tags)) for i in kept))
            bound = limits.limits().scope_assignments
            if n > bound:
                raise InvalidArgument("observation_scopes", f"{scopes.mode.upper()} puts the "
                                      f"items into {n} scopes in all (items x scopes); at "
                                      f"most {bound} (MNEME_LIMIT_SCOPE_ASSIGNMENTS): send "
                                      "fewer items or scopes per request")
        op = self.ingest.retain(bank_id, items, wait=not getattr(request, "async"),
                                rejected=rejected,
                                timeout=remaining(context, self.ingest.retain_timeout_s),
                                request_id=request.request_id, observation_scopes=scopes)
        return memory_pb2.RetainResponse(operation=apiconv.operation_to_api(op),
                                         memory_ids=op.memory_ids)

    @translate_errors
    def DeleteDocument(self, request, context):
        op = self.ingest.delete_document(bank_id_of(request.parent), request.document_id,
                                         timeout=remaining(context, self.ingest.retain_timeout_s))
        return apiconv.operation_to_api(op)

    @translate_errors
    def DeleteMemory(self, request, context):
        # the names Recall gives out (an observation or opinion in its own collection)
        bank_id, memory_id, kind = unit_of(request.name)
        if kind == "opinion":
            raise InvalidArgument("name", "an opinion is deleted with DeleteOpinion")
        if kind == "observation":
            raise InvalidArgument("name", "an observation is derived from facts: delete "
                                  "those, or ClearObservations")
        op = self.ingest.delete_memory(bank_id, memory_id,
                                       timeout=remaining(context, self.ingest.retain_timeout_s))
        return apiconv.operation_to_api(op)


    @translate_errors
    def Consolidate(self, request, context):
        bank_id = bank_id_of(request.parent)
        scopes = (apiconv.observation_scopes_from_api(request.observation_scopes)
                  if request.HasField("observation_scopes") else None)
        op = self.ingest.consolidate(bank_id, "reconsolidate" if request.reconsolidate else "consolidate",
                                     scopes, wait=not getattr(request, "async"),
                                     timeout=remaining(context, self.ingest.retain_timeout_s))
        return apiconv.operation_to_api(op)

    @translate_errors
    def ClearObservations(self, request, context):
        bank_id = bank_id_of(request.parent)
        if request.memory_id:
            memory_of(f"banks/{bank_id}/memories/{request.memory_id}", "memory_id")
        op = self.ingest.consolidate(bank_id, "clear_memory" if request.memory_id else "clear",
                                     memory_id=request.memory_id, wait=not getattr(request, "async"),
                                     timeout=remaining(context, self.ingest.retain_timeout_s))
        return apiconv.operation_to_api(op)


    @translate_errors
    def DeleteOpinion(self, request, context):
        bank_id, opinion_id = opinion_of(request.name)
        op = self.ingest.delete_opinion(bank_id, opinion_id,
                                        timeout=remaining(context, self.ingest.retain_timeout_s))
        return apiconv.operation_to_api(op)


class OperationServicer(operations_pb2_grpc.OperationServiceServicer):
    def __init__(self, ingest: Ingest):
        self.ingest = ingest

    @translate_errors
    def GetOperation(self, request, context):
        return apiconv.operation_to_api(self._operation(request.name, auth.READ))

    @translate_errors
    def CancelOperation(self, request, context):
        op = self._operation(request.name, auth.WRITE)
        return apiconv.operation_to_api(
            self.ingest.cancel_operation(op.operation_id, timeout=remaining(context, 30.0)))

    @translate_errors
    def RetryOperation(self, request, context):
        op = self._operation(request.name, auth.WRITE)
        return apiconv.operation_to_api(
            self.ingest.retry_operation(op.operation_id, timeout=remaining(context, 30.0)))

    def _operation(self, name: str, access: str):
        """The operation ``name`` names, for a caller who may ``access`` its bank. An
        operation's name does not hold its bank, so a caller whose key does not cover
        every bank is refused alike for another bank's operation and for an unknown one
        (PERMISSION_DENIED naming no bank; AIP-211: permission before existence): the
        answer tells neither that the operation exists nor whose it is. (A retain's id
        derives from its bank and request_id, so anyone who guesses both can compute
        it.) NotFound for an unknown operation only to a key of every bank."""
        op_id = operation_of(name)
        caller = auth.current()
        try:
            op = self.ingest.get_operation(op_id)
        except NotFound:
            if caller.allows(auth.ALL_BANKS, auth.READ):
                raise
            op = None
        if op is None or not caller.allows(op.bank_id, auth.READ):
            raise auth.PermissionDenied(auth.refusal(auth.READ, f"operation {op_id!r}"))
        auth.require(op.bank_id, access)  # a read key cancelling: its bank is no secret
        return op

    @translate_errors
    def ListOperations(self, request, context):
        bank_id = bank_id_of(request.parent) if request.parent else ""
        size = paging.page_size(request.page_size)
        only = operations_filter(request.filter)
        # The token is bound to its parent and filter: another bank's or filter's token is
        # refused (an unfiltered one as before filters were). It holds the last
        # operation's (created_at, id): new operations (listed first) shift nothing.
        kind = ("operations", bank_id, sorted(only.items())) if only else ("operations", bank_id)
        after = paging.decode_token(request.page_token, kind, (float, str))
        self.ingest.catch_up(bank_id or None)
        ops = self.ingest.catalog.list_operations(bank_id, size + 1,
                                                  tuple(after) if after else None, **only)
        if bank_id and not ops and after is None and self.ingest.catalog.get_bank(bank_id) is None:
            # a bank that never was (a deleted bank's operations stay listable)
            raise NotFound(f"bank {bank_id!r} not found")
        page = ops[:size]
        return operations_pb2.ListOperationsResponse(
            operations=[apiconv.operation_to_api(o) for o in page],
            next_page_token=paging.encode_token(
                kind, [float(page[-1].created_at), page[-1].operation_id])
            if len(ops) > size else "")


#: ListOperationsRequest.filter's fields: the Operation's ``state`` and ``kind`` (and
#: Hindsight's names for them, ``status`` and ``type``), each with its values, and
#: Hindsight 1.1's names for the same values (its operation ``status`` "processing" and
#: "completed", its ``type`` "consolidation"), so a client moving from it keeps its filters.
_STATES = {s: s for s in OPERATION_STATES} | {"processing": "running", "completed": "succeeded"}
_KINDS = {k: k for k in OPERATION_KINDS} | {"consolidation": "consolidate"}
OPERATION_FILTER_FIELDS = {"state": ("state", _STATES), "status": ("state", _STATES),
                           "kind": ("kind", _KINDS), "type": ("kind", _KINDS)}


def operations_filter(text: str) -> dict[str, str]:
    """ListOperationsRequest.filter as the catalog's ``list_operations`` keywords
    (``state``, ``kind``: stored values): ``state = "FAILED" AND kind = "retain"`` →
    {"state": "failed", "kind": "retain"}; "" → {}. Raises InvalidArgument naming
    ``filter`` for anything else (:func:`mneme.aipfilter.parse_equalities`)."""
    return parse_equalities(text, OPERATION_FILTER_FIELDS, "filter")


def key_ids_of(request) -> list[str]:
    """The distinct key ids of a BatchGetDataKeysRequest, in request order. Raises
    InvalidArgument naming ``key_ids`` (none) or ``key_ids[i]`` (an empty one); lengths,
    counts and characters are the limits interceptor's (:mod:`mneme.limits`)."""
    if not request.key_ids:
        raise InvalidArgument("key_ids", "required: at least one key id (the keys of a "
                                         "Seal, e.g. 'd:<document_id>#<generation>')")
    for i, k in enumerate(request.key_ids):
        if not k:
            raise InvalidArgument(f"key_ids[{i}]", "must not be empty")
    return list(dict.fromkeys(request.key_ids))


class KeyServicer(keys_pb2_grpc.KeyServiceServicer):
    """BatchGetDataKeys over :meth:`Ingest.data_keys`. The interceptor has checked the
    caller's history scope for the bank."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    @translate_errors
    def BatchGetDataKeys(self, request, context):
        found, missing = self.ingest.data_keys(bank_id_of(request.parent, "parent"),
                                               key_ids_of(request))
        resp = keys_pb2.BatchGetDataKeysResponse(missing_key_ids=missing)
        for k, key in found:
            resp.data_keys.add(key_id=k, key=key)
        return resp


def directive_to_api(d: Directive) -> directives_pb2.Directive:
    """A :class:`~mneme.domain.Directive` → Directive (times as Timestamps)."""
    return directives_pb2.Directive(
        name=directive_name(d.bank_id, d.id), id=d.id, title=d.title, text=d.text,
        priority=d.priority, active=d.active, tags=list(d.tags),
        create_time=dt_to_ts(from_epoch(d.created_at)), update_time=dt_to_ts(from_epoch(d.updated_at)))


def _directive_from_api(d: directives_pb2.Directive, bank_id: str, directive_id: str = "") -> Directive:
    return Directive(id=directive_id, bank_id=bank_id, text=d.text, title=d.title,
                     priority=d.priority, active=d.active if d.HasField("active") else True,
                     tags=tuple(d.tags))


class DirectiveServicer(directives_pb2_grpc.DirectiveServiceServicer):
    """Directive CRUD over :class:`services.ingest.handlers.Ingest` (AIP-133..135)."""

    def __init__(self, ingest: Ingest):
        self.ingest = ingest

    @translate_errors
    def CreateDirective(self, request, context):
        bank_id = bank_id_of(request.parent)
        if not request.HasField("directive"):
            raise InvalidArgument("directive", "required")
        d = self.ingest.create_directive(_directive_from_api(request.directive, bank_id),
                                         timeout=remaining(context, 30.0),
                                         directive_id=request.directive_id)
        return directive_to_api(d)

    @translate_errors
    def GetDirective(self, request, context):
        return directive_to_api(self.ingest.require_directive(*directive_of(request.name)))

    @translate_errors
    def ListDirectives(self, request, context):
        bank_id = bank_id_of(request.parent)
        size = paging.page_size(request.page_size)
        kind = ("directives", bank_id)
        after = paging.decode_token(request.page_token, kind) or ""
        self.ingest.require_bank(bank_id)
        found = self.ingest.catalog.list_directives(bank_id, size + 1, after)
        page = found[:size]
        return directives_pb2.ListDirectivesResponse(
            directives=[directive_to_api(d) for d in page],
            next_page_token=paging.encode_token(kind, page[-1].id) if len(found) > size else "")

    @translate_errors
    def UpdateDirective(self, request, context):
        if not request.HasField("directive"):
            raise InvalidArgument("directive", "required")
        bank_id, directive_id = directive_of(request.directive.name, "directive.name")
        d = self.ingest.update_directive(
            _directive_from_api(request.directive, bank_id, directive_id),
            apiconv.update_paths(request.update_mask.paths, DIRECTIVE_FIELDS, request.directive),
            timeout=remaining(context, 30.0))
        return directive_to_api(d)

    @translate_errors
    def DeleteDirective(self, request, context):
        self.ingest.delete_directive(*directive_of(request.name), timeout=remaining(context, 30.0))
        return empty_pb2.Empty()


def register(server, ingest: Ingest) -> list[str]:
    """Add ingest's servicers to ``server``; returns their full service names."""
    banks_pb2_grpc.add_BankServiceServicer_to_server(BankServicer(ingest), server)
    directives_pb2_grpc.add_DirectiveServiceServicer_to_server(DirectiveServicer(ingest), server)
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(ingest), server)
    operations_pb2_grpc.add_OperationServiceServicer_to_server(OperationServicer(ingest), server)
    keys_pb2_grpc.add_KeyServiceServicer_to_server(KeyServicer(ingest), server)
    return [banks_pb2.DESCRIPTOR.services_by_name["BankService"].full_name,
            directives_pb2.DESCRIPTOR.services_by_name["DirectiveService"].full_name,
            memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name,
            operations_pb2.DESCRIPTOR.services_by_name["OperationService"].full_name,
            keys_pb2.DESCRIPTOR.services_by_name["KeyService"].full_name]
