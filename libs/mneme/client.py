"""A small synchronous client SDK over mneme's gRPC API.

    with MnemeClient("127.0.0.1:50051") as m:
        m.upsert_bank("demo")
        m.retain("demo", [{"content": "Alice: I moved to Lisbon last May",
                           "timestamp": datetime(2024, 3, 1, tzinfo=timezone.utc)}])
        for r in m.recall("demo", "Where does Alice live?").results: ...

TLS/mTLS: ``MnemeClient(addr, tls=ClientTLS(ca=..., cert=..., key=...))`` or the
``MNEME_CLIENT_TLS_*`` variables. Errors are ``grpc.RpcError`` with the server's status code (INVALID_ARGUMENT carries
``google.rpc.BadRequest`` field violations; see :func:`field_violations`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable, Mapping

import grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from mneme.grpc_util import ClientTLS, dt_to_ts, secure_channel
from mneme.timeparse import time_zone as time_zone_of
from mneme.timeparse import time_zone_name
from mneme.v1 import generations_pb2, generations_pb2_grpc, observations_pb2, observations_pb2_grpc
from mneme.v1 import opinions_pb2, opinions_pb2_grpc
from mneme.v1 import documents_pb2, documents_pb2_grpc, entities_pb2, entities_pb2_grpc
from mneme.v1 import directives_pb2, directives_pb2_grpc, mental_models_pb2, mental_models_pb2_grpc
from mneme.v1 import keys_pb2, keys_pb2_grpc
from mneme.v1 import (banks_pb2, banks_pb2_grpc, memory_pb2, memory_pb2_grpc, operations_pb2,
                      operations_pb2_grpc, recall_pb2, recall_pb2_grpc, reflect_pb2,
                      reflect_pb2_grpc, resources_pb2)

BUDGETS = {"low": recall_pb2.LOW, "mid": recall_pb2.MID, "high": recall_pb2.HIGH}
#: RefreshMentalModel's modes by their CLI/SDK names.
REFRESH_MODES = {"full": mental_models_pb2.FULL, "delta": mental_models_pb2.DELTA}
TAGS_MATCH = {"any": recall_pb2.ANY, "all": recall_pb2.ALL, "any_strict": recall_pb2.ANY_STRICT,
              "all_strict": recall_pb2.ALL_STRICT, "exact": recall_pb2.EXACT}
TYPES = {"world": resources_pb2.WORLD, "experience": resources_pb2.EXPERIENCE,
         "observation": resources_pb2.OBSERVATION, "opinion": resources_pb2.OPINION}
SCOPE_MODES = {"exact": resources_pb2.ObservationScopes.EXACT,
               "per_tag": resources_pb2.ObservationScopes.PER_TAG,
               "combined": resources_pb2.ObservationScopes.COMBINED,
               "shared": resources_pb2.ObservationScopes.SHARED,
               "explicit": resources_pb2.ObservationScopes.EXPLICIT}


def _pick(field: str, value: str, table: Mapping[str, int]) -> int:
    """The enum number of ``value`` in ``table`` (by name); ValueError naming ``field``
    and the allowed names otherwise."""
    try:
        return table[value]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: {value!r} is not one of {', '.join(table)}") from None


def _strings(field: str, values: Iterable[str] | None) -> list[str]:
    """``values`` as a list; TypeError naming ``field`` for a single string (which
    would be sent as one entry per character)."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{field}: a list of strings, not the single string {values!r}")
    return list(values or ())


def _when(field: str, value) -> "datetime | None":
    """``value`` when it is a datetime or None; TypeError naming ``field`` otherwise (a
    string or a number would be dropped, and the server's clock used instead)."""
    if value is not None and not isinstance(value, datetime):
        raise TypeError(f"{field}: a datetime (aware, or naive = UTC / its time_zone), "
                        f"not {type(value).__name__} {value!r}")
    return value


def observation_scopes(mode: str, scopes: Iterable[Iterable[str]] = ()) -> resources_pb2.ObservationScopes:
    """``mode`` in exact, per_tag, combined, shared, explicit (with ``scopes``: tag lists)."""
    return resources_pb2.ObservationScopes(
        mode=_pick("observation_scopes.mode", mode, SCOPE_MODES),
        scopes=[resources_pb2.ObservationScopes.Scope(
            tags=_strings(f"observation_scopes.scopes[{i}].tags", t))
            for i, t in enumerate(scopes)])


#: Mental-model refresh policies by name (the CLI's choices).
REFRESH_POLICIES = {"manual": 1, "after_consolidation": 2, "every_n_facts": 3}


def _mental_model(**fields) -> "mental_models_pb2.MentalModel":
    """A MentalModel message of keyword fields (``refresh_policy`` by name)."""
    policy = fields.pop("refresh_policy", None)
    m = mental_models_pb2.MentalModel(**fields)
    if policy is not None:
        m.refresh_policy = _pick("refresh_policy", policy, REFRESH_POLICIES)
    return m


def field_violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of an INVALID_ARGUMENT error, else []."""
    status = rpc_status.from_call(err)
    out = []
    for d in status.details if status else []:
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out += [(v.field, v.description) for v in br.field_violations]
    return out


def _local(ts: datetime | None, time_zone: str | None) -> datetime | None:
    """A naive ``ts`` read on the clock of ``time_zone`` when one is given (and known);
    aware ones, and naive ones without a zone (UTC), as they are."""
    if not isinstance(ts, datetime) or ts.tzinfo is not None or not time_zone:
        return ts
    try:
        return ts.replace(tzinfo=time_zone_of(time_zone))
    except ValueError:  # the server refuses the zone, naming the field
        return ts


def _zone(ts: datetime | None, time_zone: str | None) -> str:
    """The time_zone to send: the one given, else the zone of an aware ``ts`` (a
    ``ZoneInfo`` as its IANA name, a fixed offset as "+HH:MM"), else "" (UTC)."""
    if time_zone is not None:
        return time_zone
    return time_zone_name(ts) if isinstance(ts, datetime) else ""


#: The keys of a retain item given as a mapping.
ITEM_KEYS = ("content", "context", "timestamp", "time_zone", "document_id", "tags", "metadata")


def _item(i: Mapping | memory_pb2.RetainItem, index: int = 0) -> memory_pb2.RetainItem:
    """A retain item from a mapping (content, context, timestamp, time_zone, document_id,
    tags, metadata); an aware timestamp's zone is the item's time_zone unless one is given.
    ValueError / TypeError naming ``items[index]`` and the key for a mapping that would
    be sent as something else: an unknown (misspelt) key, no content, a timestamp that is
    not a datetime, tags given as one string, metadata that is not a mapping."""
    if isinstance(i, memory_pb2.RetainItem):
        return i
    at = f"items[{index}]"
    if not isinstance(i, Mapping):
        raise TypeError(f"{at}: a mapping with {', '.join(ITEM_KEYS)} or a RetainItem, "
                        f"not {type(i).__name__}")
    unknown = [k for k in i if k not in ITEM_KEYS]
    if unknown:
        raise ValueError(f"{at}: unknown key {unknown[0]!r}; one of {', '.join(ITEM_KEYS)}")
    if "content" not in i:
        raise ValueError(f"{at}.content: required")
    metadata = i.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{at}.metadata: a mapping of strings, not {type(metadata).__name__}")
    ts = _local(_when(f"{at}.timestamp", i.get("timestamp")), i.get("time_zone"))
    return memory_pb2.RetainItem(
        content=i["content"], context=i.get("context", ""),
        timestamp=dt_to_ts(ts) if isinstance(ts, datetime) else None,
        document_id=i.get("document_id", ""), tags=_strings(f"{at}.tags", i.get("tags")),
        metadata={k: str(v) for k, v in metadata.items()},
        time_zone=_zone(ts, i.get("time_zone")))


class _CallMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <key>`` (when a key is given) and the current span's
    ``traceparent`` to every call."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    def _details(self, d):
        from mneme import telemetry
        md = list(d.metadata or ())
        if self.api_key:
            md.append(("authorization", f"Bearer {self.api_key}"))
        md.extend(telemetry.inject({}).items())
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(
            d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready,
                                                                   compression)


_UNSET = object()


def api_channel(address: str, options=(), api_key: str | None = None,
                tls: ClientTLS | None | object = _UNSET) -> grpc.Channel:
    """A channel to ``address`` carrying ``api_key`` (default ``$MNEME_API_KEY``) and trace
    context on every call. ``tls``: a :class:`mneme.grpc_util.ClientTLS` (its files are
    re-read when they change), None for plaintext; default from ``MNEME_CLIENT_TLS_*``
    (plaintext when none is set)."""
    import os
    key = api_key if api_key is not None else os.environ.get("MNEME_API_KEY") or None
    tls = ClientTLS.from_env() if tls is _UNSET else tls
    return grpc.intercept_channel(secure_channel(address, tls, options), _CallMetadata(key))


class MnemeClient:
    """Client of every mneme API on one address (``host:port``). ``timeout`` is the
    default per-call deadline in seconds; ``api_key`` (default ``$MNEME_API_KEY``) is sent
    as ``authorization: Bearer <key>`` on every call. ``tls``: TLS, and the client
    certificate for an mtls server, as a :class:`mneme.grpc_util.ClientTLS`, e.g.
    ``ClientTLS(ca="ca.pem", cert="me.pem", key="me.key")``; None: plaintext; default
    from ``MNEME_CLIENT_TLS_CA``/``_CERT``/``_KEY``/``_SERVER_NAME`` (plaintext when none
    is set). The files are re-read when they change (a new channel after a rotation).
    Raises ValueError when ``address`` is neither HOST:PORT (port 0..65535) nor a gRPC
    target with a scheme."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float = 600.0,
                 api_key: str | None = None, tls: ClientTLS | None | object = _UNSET):
        from mneme.names import check_address
        check_address(address)  # ValueError: not HOST:PORT (or a gRPC target)
        self.channel = api_channel(address, [("grpc.max_receive_message_length", 64 << 20),
                                             ("grpc.max_send_message_length", 64 << 20)],
                                   api_key=api_key, tls=tls)
        self.timeout = timeout
        self.banks = banks_pb2_grpc.BankServiceStub(self.channel)
        self.memory = memory_pb2_grpc.MemoryServiceStub(self.channel)
        self.recall_stub = recall_pb2_grpc.RecallServiceStub(self.channel)
        self.reflect_stub = reflect_pb2_grpc.ReflectServiceStub(self.channel)
        self.operations = operations_pb2_grpc.OperationServiceStub(self.channel)
        self.observations = observations_pb2_grpc.ObservationServiceStub(self.channel)
        self.opinions = opinions_pb2_grpc.OpinionServiceStub(self.channel)
        self.entities = entities_pb2_grpc.EntityServiceStub(self.channel)
        self.directives = directives_pb2_grpc.DirectiveServiceStub(self.channel)
        self.mental_models = mental_models_pb2_grpc.MentalModelServiceStub(self.channel)
        self.documents = documents_pb2_grpc.DocumentServiceStub(self.channel)
        self.generations = generations_pb2_grpc.GenerationServiceStub(self.channel)
        self.key_service = keys_pb2_grpc.KeyServiceStub(self.channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _pages(self, call, request, field: str):
        """Every item of a List RPC: ``call(request)`` page after page (its
        ``page_token`` set from each response's ``next_page_token``), yielding the
        items of the response's ``field``."""
        while True:
            r = call(request, timeout=self.timeout)
            yield from getattr(r, field)
            if not r.next_page_token:
                return
            request.page_token = r.next_page_token

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server accepts connections (raises grpc.FutureTimeoutError)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    # banks
    def upsert_bank(self, bank_id: str, display_name: str = "", **config) -> resources_pb2.Bank:
        """Create the bank, or REPLACE the name and whole config of an existing one
        (fields not given take their defaults). To change some fields and keep the
        others, use :meth:`update_bank`."""
        bank = resources_pb2.Bank(name=f"banks/{bank_id}", display_name=display_name,
                                  config=resources_pb2.BankConfig(**config))
        return self.banks.UpsertBank(banks_pb2.UpsertBankRequest(bank=bank), timeout=self.timeout)

    def update_bank(self, bank_id: str, display_name: str | None = None,
                    **config) -> resources_pb2.Bank:
        """Change only the given fields of an existing bank (UpdateBank with an
        ``update_mask`` of exactly those fields): ``display_name`` and/or BankConfig fields
        as keywords, e.g. ``update_bank("b", retain_mission="...")``. NOT_FOUND for an
        unknown bank."""
        from google.protobuf import field_mask_pb2
        paths = (["display_name"] if display_name is not None else []) + [
            f"config.{k}" for k in config]
        bank = resources_pb2.Bank(name=f"banks/{bank_id}", display_name=display_name or "",
                                  config=resources_pb2.BankConfig(**config))
        return self.banks.UpdateBank(banks_pb2.UpdateBankRequest(
            bank=bank, update_mask=field_mask_pb2.FieldMask(paths=paths)), timeout=self.timeout)

    def get_bank(self, bank_id: str) -> resources_pb2.Bank:
        return self.banks.GetBank(banks_pb2.GetBankRequest(name=f"banks/{bank_id}"), timeout=self.timeout)

    def list_banks(self) -> list[resources_pb2.Bank]:
        return list(self._pages(self.banks.ListBanks, banks_pb2.ListBanksRequest(page_size=100),
                                "banks"))

    def delete_bank(self, bank_id: str) -> None:
        self.banks.DeleteBank(banks_pb2.DeleteBankRequest(name=f"banks/{bank_id}"), timeout=self.timeout)

    def check_llm(self, bank_id: str) -> banks_pb2.CheckLlmResponse:
        """Probe the language models the bank would use (empty checks: offline)."""
        return self.banks.CheckLlm(banks_pb2.CheckLlmRequest(name=f"banks/{bank_id}"),
                                   timeout=self.timeout)

    def bank_profile(self, bank_id: str) -> banks_pb2.BankProfile:
        """The bank's config, counts (documents, directives, mental models too) and its
        latest activity."""
        return self.banks.GetBankProfile(banks_pb2.GetBankProfileRequest(
            name=f"banks/{bank_id}"), timeout=self.timeout)

    def bank_stats(self, bank_id: str) -> banks_pb2.BankStats:
        """Facts, observations, entities and pending work (operations, consumer lag)."""
        return self.banks.GetBankStats(banks_pb2.GetBankStatsRequest(name=f"banks/{bank_id}"),
                                       timeout=self.timeout)

    def list_operations(self, bank_id: str = "", page_size: int = 100, filter: str = ""):
        """Yield operations (newest first per the catalog), of one bank or of every bank;
        ``filter`` keeps those it selects (``'state = "FAILED" AND kind = "retain"'``:
        ListOperationsRequest.filter)."""
        yield from self._pages(self.operations.ListOperations, operations_pb2.ListOperationsRequest(
            parent=f"banks/{bank_id}" if bank_id else "", page_size=page_size, filter=filter),
            "operations")

    # store generations (replay while serving)
    def replay(self, force: bool = False, wait: bool = True, poll_s: float = 0.5,
               progress=None) -> generations_pb2.Generation:
        """Rebuild the server's search stores from the log into a new generation while the
        live one serves; it becomes live after a check (``force``: despite the check).
        ``wait``: poll until it is LIVE or FAILED (``progress(done, total)`` on each poll)
        and return it; else return it BUILDING. FAILED_PRECONDITION while a replay runs."""
        import time
        g = self.generations.CreateGeneration(
            generations_pb2.CreateGenerationRequest(force=force), timeout=self.timeout)
        while wait and g.state == generations_pb2.Generation.BUILDING:
            time.sleep(poll_s)
            g = self.get_generation(g.generation)
            if progress:
                progress(g.records_done, g.records_total)
        return g

    def get_generation(self, generation: int) -> generations_pb2.Generation:
        return self.generations.GetGeneration(generations_pb2.GetGenerationRequest(
            name=f"generations/{generation}"), timeout=self.timeout)

    def list_generations(self, page_size: int = 100):
        """Yield the server's store generations, oldest first."""
        yield from self._pages(self.generations.ListGenerations,
                               generations_pb2.ListGenerationsRequest(page_size=page_size),
                               "generations")

    def delete_generation(self, generation: int) -> None:
        """Drop a RETIRED or FAILED generation's stores (cancels a BUILDING one)."""
        self.generations.DeleteGeneration(generations_pb2.DeleteGenerationRequest(
            name=f"generations/{generation}"), timeout=self.timeout)

    # memory
    def retain(self, bank_id: str, items: Iterable[Mapping | memory_pb2.RetainItem],
               async_: bool = False, timeout: float | None = None,
               request_id: str = "",
               observation_scopes: resources_pb2.ObservationScopes | None = None
               ) -> memory_pb2.RetainResponse:
        """Retain items (dicts with content, timestamp, time_zone, context, document_id, tags,
        metadata; an aware timestamp's zone is the time_zone unless one is given, and a
        naive one is read on the clock of the time_zone given, else as UTC).
        ``request_id`` makes retries idempotent; ``observation_scopes`` (see
        :func:`observation_scopes`) picks the scopes the facts consolidate into."""
        req = memory_pb2.RetainRequest(parent=f"banks/{bank_id}",
                                       items=[_item(it, n) for n, it in enumerate(items)],
                                       request_id=request_id, observation_scopes=observation_scopes)
        setattr(req, "async", async_)
        return self.memory.Retain(req, timeout=timeout or self.timeout)

    def delete_document(self, bank_id: str, document_id: str) -> operations_pb2.Operation:
        return self.memory.DeleteDocument(memory_pb2.DeleteDocumentRequest(
            parent=f"banks/{bank_id}", document_id=document_id), timeout=self.timeout)

    def delete_memory(self, bank_id: str, memory_id: str) -> operations_pb2.Operation:
        return self.memory.DeleteMemory(memory_pb2.DeleteMemoryRequest(
            name=f"banks/{bank_id}/memories/{memory_id}"), timeout=self.timeout)

    def get_memory(self, bank_id: str, memory_id: str) -> resources_pb2.Memory:
        return self.recall_stub.GetMemory(memory_pb2.GetMemoryRequest(
            name=f"banks/{bank_id}/memories/{memory_id}"), timeout=self.timeout)

    def list_memories(self, bank_id: str, document_id: str = "", page_size: int = 500):
        """Yield every memory of the bank (all pages)."""
        yield from self._pages(self.recall_stub.ListMemories, memory_pb2.ListMemoriesRequest(
            parent=f"banks/{bank_id}", page_size=page_size, document_id=document_id), "memories")

    # directives
    def create_directive(self, bank_id: str, text: str, *, title: str = "", priority: int = 0,
                         active: bool = True, tags: Iterable[str] = (),
                         directive_id: str = "") -> directives_pb2.Directive:
        """Create a directive (a rule reflect follows) in the bank; returns it with its id.
        ``directive_id``: a UUID of your choosing (AIP-133), so that retrying a call whose
        answer was lost gets ALREADY_EXISTS instead of making a second directive."""
        return self.directives.CreateDirective(directives_pb2.CreateDirectiveRequest(
            parent=f"banks/{bank_id}", directive=directives_pb2.Directive(
                text=text, title=title, priority=priority, active=active,
                tags=_strings("tags", tags)), directive_id=directive_id),
            timeout=self.timeout)

    def get_directive(self, bank_id: str, directive_id: str) -> directives_pb2.Directive:
        return self.directives.GetDirective(directives_pb2.GetDirectiveRequest(
            name=f"banks/{bank_id}/directives/{directive_id}"), timeout=self.timeout)

    def list_directives(self, bank_id: str, page_size: int = 500):
        """Yield every directive of the bank in id order (all pages)."""
        yield from self._pages(self.directives.ListDirectives, directives_pb2.ListDirectivesRequest(
            parent=f"banks/{bank_id}", page_size=page_size), "directives")

    def update_directive(self, bank_id: str, directive_id: str, **fields) -> directives_pb2.Directive:
        """Change exactly the given fields (title, text, priority, active, tags)."""
        d = directives_pb2.Directive(name=f"banks/{bank_id}/directives/{directive_id}")
        for k, v in fields.items():
            if k == "tags":
                d.tags.extend(v)
            else:
                setattr(d, k, v)
        req = directives_pb2.UpdateDirectiveRequest(directive=d)
        req.update_mask.paths.extend(fields)
        return self.directives.UpdateDirective(req, timeout=self.timeout)

    def delete_directive(self, bank_id: str, directive_id: str) -> None:
        self.directives.DeleteDirective(directives_pb2.DeleteDirectiveRequest(
            name=f"banks/{bank_id}/directives/{directive_id}"), timeout=self.timeout)

    # mental models
    def create_mental_model(self, bank_id: str, display_name: str, source_query: str, *,
                            content: str = "", tags: Iterable[str] = (), max_tokens: int = 0,
                            refresh_policy: str = "manual", refresh_every: int = 0,
                            mental_model_id: str = "") -> mental_models_pb2.MentalModel:
        """Create a mental model (a standing answer to ``source_query``) in the bank.
        ``mental_model_id``: a UUID of your choosing (AIP-133), so that retrying a call
        whose answer was lost gets ALREADY_EXISTS instead of making a second model."""
        return self.mental_models.CreateMentalModel(mental_models_pb2.CreateMentalModelRequest(
            parent=f"banks/{bank_id}", mental_model=_mental_model(
                display_name=display_name, source_query=source_query, content=content,
                tags=_strings("tags", tags), max_tokens=max_tokens,
                refresh_policy=refresh_policy,
                refresh_every=refresh_every), mental_model_id=mental_model_id),
            timeout=self.timeout)

    def get_mental_model(self, bank_id: str, model_id: str) -> mental_models_pb2.MentalModel:
        return self.mental_models.GetMentalModel(mental_models_pb2.GetMentalModelRequest(
            name=f"banks/{bank_id}/mental-models/{model_id}"), timeout=self.timeout)

    def list_mental_models(self, bank_id: str, tags: Iterable[str] = (), page_size: int = 500,
                           tags_match: str = "any"):
        """Yield every mental model of the bank in id order (with ``tags``: those matching
        them in ``tags_match`` mode, as recall's)."""
        yield from self._pages(
            self.mental_models.ListMentalModels, mental_models_pb2.ListMentalModelsRequest(
                parent=f"banks/{bank_id}", page_size=page_size,
                tags=_strings("tags", tags),
                tags_match=_pick("tags_match", tags_match, TAGS_MATCH)), "mental_models")

    def update_mental_model(self, bank_id: str, model_id: str, **fields
                            ) -> mental_models_pb2.MentalModel:
        """Change exactly the given fields (display_name, source_query, content, tags,
        max_tokens, refresh_policy, refresh_every)."""
        m = _mental_model(**fields)
        m.name = f"banks/{bank_id}/mental-models/{model_id}"
        req = mental_models_pb2.UpdateMentalModelRequest(mental_model=m)
        req.update_mask.paths.extend(fields)
        return self.mental_models.UpdateMentalModel(req, timeout=self.timeout)

    def clear_mental_model(self, bank_id: str, model_id: str) -> mental_models_pb2.MentalModel:
        """Empty the model's content until its next refresh (a revision of its own)."""
        return self.mental_models.ClearMentalModel(mental_models_pb2.ClearMentalModelRequest(
            name=f"banks/{bank_id}/mental-models/{model_id}"), timeout=self.timeout)

    def delete_mental_model(self, bank_id: str, model_id: str) -> None:
        self.mental_models.DeleteMentalModel(mental_models_pb2.DeleteMentalModelRequest(
            name=f"banks/{bank_id}/mental-models/{model_id}"), timeout=self.timeout)

    def mental_model_revisions(self, bank_id: str, model_id: str, page_size: int = 100) -> list:
        """Every revision of the model's content, oldest first."""
        return list(self._pages(
            self.mental_models.ListMentalModelRevisions,
            mental_models_pb2.ListMentalModelRevisionsRequest(
                parent=f"banks/{bank_id}/mental-models/{model_id}", page_size=page_size),
            "revisions"))

    def refresh_mental_model(self, bank_id: str, model_id: str, budget: str = "mid",
                             dry_run: bool = False, mode: str = "full"
                             ) -> mental_models_pb2.MentalModel:
        """Answer its source query again and store it (``dry_run``: only return it);
        ``mode`` "delta" revises the content with what changed in its scope since."""
        return self.mental_models.RefreshMentalModel(mental_models_pb2.RefreshMentalModelRequest(
            name=f"banks/{bank_id}/mental-models/{model_id}",
            budget=_pick("budget", budget, BUDGETS), dry_run=dry_run,
            mode=_pick("mode", mode, REFRESH_MODES)), timeout=self.timeout)

    # entities, documents, tags
    def list_entities(self, bank_id: str, page_size: int = 500, tags: Iterable[str] = (),
                      tags_match: str = "any"):
        """Yield every entity of the bank in id order (all pages), with mention counts.
        With ``tags``: only those a memory matching them in ``tags_match`` mode (as
        :meth:`recall`'s) mentions, counted and dated over the matching memories."""
        yield from self._pages(self.entities.ListEntities, entities_pb2.ListEntitiesRequest(
            parent=f"banks/{bank_id}", page_size=page_size, tags=_strings("tags", tags),
            tags_match=_pick("tags_match", tags_match, TAGS_MATCH)), "entities")

    def get_entity(self, bank_id: str, entity_id: str, tags: Iterable[str] = (),
                   tags_match: str = "any") -> entities_pb2.Entity:
        """One entity with the memories mentioning it and its co-mentioned neighbours
        (with ``tags``, as :meth:`list_entities`: over the matching memories only;
        NOT_FOUND when none mentions it)."""
        return self.entities.GetEntity(entities_pb2.GetEntityRequest(
            name=f"banks/{bank_id}/entities/{entity_id}", tags=_strings("tags", tags),
            tags_match=_pick("tags_match", tags_match, TAGS_MATCH)), timeout=self.timeout)

    def merge_entities(self, bank_id: str, entity_ids: list[str],
                       display_name: str = "") -> entities_pb2.Entity:
        """Merge the entities ``entity_ids`` (2 to 100) into the first; ``display_name``
        renames it. Returns the survivor once the graph holds the merge."""
        return self.entities.MergeEntities(entities_pb2.MergeEntitiesRequest(
            parent=f"banks/{bank_id}",
            entities=[f"banks/{bank_id}/entities/{e}"
                      for e in _strings("entity_ids", entity_ids)],
            display_name=display_name), timeout=self.timeout)

    def split_entity(self, bank_id: str, entity_id: str, display_name: str,
                     aliases: list[str] = (), memory_ids: list[str] = ()
                     ) -> entities_pb2.SplitEntityResponse:
        """Split a new entity ``display_name`` off ``entity_id``: it takes ``aliases``
        (with the memories naming them) and ``memory_ids``. Returns both entities once
        the graph holds the split."""
        return self.entities.SplitEntity(entities_pb2.SplitEntityRequest(
            name=f"banks/{bank_id}/entities/{entity_id}",
            aliases=_strings("aliases", aliases),
            memories=[f"banks/{bank_id}/memories/{m}"
                      for m in _strings("memory_ids", memory_ids)],
            display_name=display_name), timeout=self.timeout)

    def list_documents(self, bank_id: str, page_size: int = 500):
        """Yield every document of the bank in document id order, with memory and
        revision counts and times (no text, memories or history: :meth:`get_document`)."""
        yield from self._pages(self.documents.ListDocuments, documents_pb2.ListDocumentsRequest(
            parent=f"banks/{bank_id}", page_size=page_size), "documents")

    def get_document(self, bank_id: str, document_id: str) -> documents_pb2.Document:
        """One document: its original text (``original_text``, empty when the bank does
        not store documents), its history of retains (``history``, the latest 100, oldest
        first), its memories (item order, the first 1000 of ``memory_count``) and chunk
        ids. NOT_FOUND when the bank has no such document (deleted ones included)."""
        return self.documents.GetDocument(documents_pb2.GetDocumentRequest(
            parent=f"banks/{bank_id}", document_id=document_id), timeout=self.timeout)

    def list_tags(self, bank_id: str, page_size: int = 500):
        """Yield every tag on the bank's memories in tag order, with memory counts."""
        yield from self._pages(self.documents.ListTags, documents_pb2.ListTagsRequest(
            parent=f"banks/{bank_id}", page_size=page_size), "tags")

    # recall / reflect
    def recall(self, bank_id: str, query: str, *, max_tokens: int = 0, budget: str = "mid",
               types: Iterable[str] = (), tags: Iterable[str] = (), tags_match: str = "any",
               query_timestamp: datetime | None = None, document_id: str = "",
               time_zone: str | None = None, include_entities: int | None = None,
               include_documents: int | None = None) -> recall_pb2.RecallResponse:
        """Recall from the bank. ``query_timestamp`` is "now" for relative expressions in
        the query (default: the server's clock), read in ``time_zone`` (default: the zone
        of an aware ``query_timestamp``, else UTC; a naive ``query_timestamp`` is read on
        the clock of ``time_zone``). ``include_entities`` / ``include_documents``: also
        return the entities the results mention (with observations) / the stored text of
        the documents they come from, within that many tokens (0: the server's default;
        None: not asked for)."""
        include = None
        if include_entities is not None or include_documents is not None:
            include = recall_pb2.RecallInclude(
                entities=None if include_entities is None
                else recall_pb2.EntityInclude(max_tokens=include_entities),
                documents=None if include_documents is None
                else recall_pb2.DocumentInclude(max_tokens=include_documents))
        return self.recall_stub.Recall(recall_pb2.RecallRequest(include=include,
            parent=f"banks/{bank_id}", query=query, max_tokens=max_tokens,
            budget=_pick("budget", budget, BUDGETS),
            types=[_pick(f"types[{n}]", t, TYPES) for n, t in enumerate(_strings("types", types))],
            tags=_strings("tags", tags), tags_match=_pick("tags_match", tags_match, TAGS_MATCH),
            query_timestamp=dt_to_ts(_local(_when("query_timestamp", query_timestamp),
                                            time_zone)), document_id=document_id,
            time_zone=_zone(query_timestamp, time_zone)), timeout=self.timeout)

    # observations
    def consolidate(self, bank_id: str, scopes: resources_pb2.ObservationScopes | None = None,
                    reconsolidate: bool = False) -> operations_pb2.Operation:
        """Consolidate pending facts (or re-derive all, ``reconsolidate``); waits."""
        return self.memory.Consolidate(memory_pb2.ConsolidateRequest(
            parent=f"banks/{bank_id}", observation_scopes=scopes, reconsolidate=reconsolidate),
            timeout=self.timeout)

    def clear_observations(self, bank_id: str, memory_id: str = "") -> operations_pb2.Operation:
        return self.memory.ClearObservations(memory_pb2.ClearObservationsRequest(
            parent=f"banks/{bank_id}", memory_id=memory_id), timeout=self.timeout)

    def list_observations(self, bank_id: str, scope: Iterable[str] | None = None,
                          page_size: int = 500):
        """Every observation (of one exact scope when ``scope`` is not None), paged."""
        yield from self._pages(self.observations.ListObservations,
                               observations_pb2.ListObservationsRequest(
                                   parent=f"banks/{bank_id}", page_size=page_size,
                                   scope=_strings("scope", scope),
                                   has_scope=scope is not None),
                               "observations")

    def list_observation_scopes(self, bank_id: str, page_size: int = 100) -> list:
        return list(self._pages(self.observations.ListObservationScopes,
                                observations_pb2.ListObservationScopesRequest(
                                    parent=f"banks/{bank_id}", page_size=page_size), "scopes"))

    def get_observation(self, bank_id: str, observation_id: str) -> resources_pb2.Observation:
        return self.observations.GetObservation(observations_pb2.GetObservationRequest(
            name=f"banks/{bank_id}/observations/{observation_id}"), timeout=self.timeout)

    # opinions

    def list_opinions(self, bank_id: str, entity_id: str = "", page_size: int = 100):
        """Every opinion of the bank (about one entity when ``entity_id`` is set), paged,
        in id order."""
        yield from self._pages(self.opinions.ListOpinions, opinions_pb2.ListOpinionsRequest(
            parent=f"banks/{bank_id}", page_size=page_size, entity_id=entity_id), "opinions")

    def get_opinion(self, bank_id: str, opinion_id: str) -> resources_pb2.Opinion:
        return self.opinions.GetOpinion(opinions_pb2.GetOpinionRequest(
            name=f"banks/{bank_id}/opinions/{opinion_id}"), timeout=self.timeout)

    def delete_opinion(self, bank_id: str, opinion_id: str) -> operations_pb2.Operation:
        """Delete one opinion; the operation ends FAILED ("opinion not found") when the
        bank has none by that id."""
        return self.memory.DeleteOpinion(memory_pb2.DeleteOpinionRequest(
            name=f"banks/{bank_id}/opinions/{opinion_id}"), timeout=self.timeout)

    def _reflect_request(self, bank_id, query, context, budget, response_schema,
                         query_timestamp=None, tags: Iterable[str] = (), time_zone=None,
                         tags_match: str = "any", max_tokens: int = 0):
        req = reflect_pb2.ReflectRequest(parent=f"banks/{bank_id}", query=query,
                                         context=context,
                                         budget=_pick("budget", budget, BUDGETS),
                                         query_timestamp=dt_to_ts(_local(
                                             _when("query_timestamp", query_timestamp),
                                             time_zone)),
                                         tags=_strings("tags", tags),
                                         tags_match=_pick("tags_match", tags_match, TAGS_MATCH),
                                         max_tokens=max_tokens,
                                         time_zone=_zone(query_timestamp, time_zone))
        if response_schema is not None:
            from google.protobuf import json_format
            json_format.ParseDict(response_schema, req.response_schema)
        return req

    def reflect(self, bank_id: str, query: str, context: str = "", budget: str = "mid",
                response_schema: dict | None = None,
                query_timestamp: datetime | None = None,
                tags: Iterable[str] = (), time_zone: str | None = None, tags_match: str = "any",
                max_tokens: int = 0) -> reflect_pb2.ReflectResponse:
        """Answer ``query`` from the bank; ``response_schema`` (a JSON schema dict) asks
        for structured output as well (needs a reflect model on the server);
        ``query_timestamp`` is "now" for relative questions (default: the server's clock),
        read in ``time_zone`` (default: the zone of an aware ``query_timestamp``, else UTC);
        ``tags`` the scope (the bank's directives with one of them apply too), matched in
        ``tags_match`` mode as :meth:`recall` matches it; ``max_tokens`` the bound of the
        answer's length (0: the server's default)."""
        return self.reflect_stub.Reflect(self._reflect_request(
            bank_id, query, context, budget, response_schema, query_timestamp, tags, time_zone,
            tags_match, max_tokens), timeout=self.timeout)

    def stream_reflect(self, bank_id: str, query: str, context: str = "", budget: str = "mid",
                       response_schema: dict | None = None,
                       query_timestamp: datetime | None = None, tags: Iterable[str] = (),
                       time_zone: str | None = None, tags_match: str = "any",
                       max_tokens: int = 0):
        """Yield ReflectEvents: tool calls, text deltas, then ``done`` with the response
        (arguments as :meth:`reflect`)."""
        yield from self.reflect_stub.StreamReflect(self._reflect_request(
            bank_id, query, context, budget, response_schema, query_timestamp, tags, time_zone,
            tags_match, max_tokens), timeout=self.timeout)

    # the history (external consumers of the log)

    def batch_get_data_keys(self, bank_id: str, key_ids: Iterable[str]
                            ) -> tuple[dict[str, bytes], list[str]]:
        """The data keys ``key_ids`` of ``bank_id`` (at most 1000): ``({key_id: 32
        bytes}, missing key ids)`` -- missing ones are destroyed (deleted content) or
        unknown. Needs a key with the ``history`` scope for the bank (else
        PERMISSION_DENIED)."""
        r = self.key_service.BatchGetDataKeys(keys_pb2.BatchGetDataKeysRequest(
            parent=f"banks/{bank_id}", key_ids=_strings("key_ids", key_ids)),
            timeout=self.timeout)
        return {k.key_id: k.key for k in r.data_keys}, list(r.missing_key_ids)

    def history_opener(self, cache: int = 100_000, max_age_s: float = 300.0,
                       batch: int = 1000):
        """A :class:`mneme.history.HistoryOpener`: ``open(record)`` decodes a record of
        the topics (or the embedded log) with its sealed content opened, with keys from
        :meth:`batch_get_data_keys` (cached: ``cache`` keys for ``max_age_s`` seconds;
        at most ``batch`` ids a call: the server's MNEME_LIMIT_KEY_IDS).
        Content whose key was destroyed comes erased (README "Reading the history")."""
        from mneme.history import HistoryOpener, RemoteKeys
        return HistoryOpener(RemoteKeys(self.batch_get_data_keys, cache=cache,
                                        max_age_s=max_age_s, batch=batch))

    def get_operation(self, operation_id: str) -> operations_pb2.Operation:
        """The operation ``operation_id`` (a bare id or ``operations/{id}``)."""
        return self.operations.GetOperation(operations_pb2.GetOperationRequest(
            name=_operation_name(operation_id)), timeout=self.timeout)

    def cancel_operation(self, operation_id: str) -> operations_pb2.Operation:
        """Request the cancellation of a pending or running retain (a bare id or
        ``operations/{id}``); returns it with ``cancel_requested``. It then ends FAILED
        with ``cancelled`` (items stored before the cancel stay). FAILED_PRECONDITION
        when it has ended or is not a retain."""
        return self.operations.CancelOperation(operations_pb2.CancelOperationRequest(
            name=_operation_name(operation_id)), timeout=self.timeout)

    def retry_operation(self, operation_id: str) -> operations_pb2.Operation:
        """Run an ended retain's failed items again (its item errors; every item when it
        failed as a whole); returns the new operation (``retry_of`` names the old one;
        poll it with :meth:`get_operation`). FAILED_PRECONDITION while it runs, when
        nothing failed, or when nothing of it can be retried."""
        return self.operations.RetryOperation(operations_pb2.RetryOperationRequest(
            name=_operation_name(operation_id)), timeout=self.timeout)


def _operation_name(operation_id: str) -> str:
    """``operations/{id}`` of a bare id or of a name."""
    return operation_id if operation_id.startswith("operations/") else f"operations/{operation_id}"
