"""reflect's gRPC servicers: ReflectService (Reflect, StreamReflect) and
MentalModelService."""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone
from typing import Callable, ContextManager, Iterator

from google.protobuf import empty_pb2, json_format, struct_pb2

from mneme import apiconv, deadline, paging
from mneme.domain import MENTAL_MODEL_FIELDS, MentalModel, from_epoch
from mneme.errors import InvalidArgument, MnemeError, NotFound
from mneme.grpc_util import (abort_for, call_deadline, dt_to_ts, remaining, translate_errors,
                             ts_to_dt)
from mneme.names import bank_id_of, memory_name, mental_model_name, mental_model_of
from mneme.timeparse import wall_clock
from mneme.v1 import mental_models_pb2, mental_models_pb2_grpc, reflect_pb2, reflect_pb2_grpc
from services.reflect.handlers import Reflection


def response_to_api(r: Reflection) -> reflect_pb2.ReflectResponse:
    """A Reflection (offline or agent) → ReflectResponse."""
    kinds = r.kinds
    resp = reflect_pb2.ReflectResponse(
        text=r.text, based_on=r.based_on, extractive=r.extractive,
        dropped_citations=getattr(r, "dropped_citations", []),
        sources=reflect_pb2.ReflectSources(
            facts=[i for i in r.based_on if i not in kinds],
            observations=[i for i in r.based_on if kinds.get(i) == "observation"],
            mental_models=[i for i in r.based_on if kinds.get(i) == "mental_model"],
            directives=r.directives))
    structured = getattr(r, "structured", None)
    if structured is not None:
        v = struct_pb2.Value()
        json_format.ParseDict(structured, v)
        resp.structured.CopyFrom(v)
    return resp


class ReflectServicer(reflect_pb2_grpc.ReflectServiceServicer):
    """``reflect(bank_id, query, context, budget, now, response_schema, tags, *,
    tags_match, max_tokens) -> Reflection``;
    ``stream(...)`` yields the agent's ToolEvent / TextDelta / Done events. ``slot(bank_id)`` is
    held by each reflection (a context manager: :meth:`mneme.slots.WaitSlots.hold`, which
    raises ResourceExhausted when the process's waiting calls are all taken), so that
    reflections waiting on a slow model cannot take every gRPC worker."""

    def __init__(self, reflect: Callable[..., Reflection], bank_exists: Callable[[str], bool],
                 stream: Callable[..., Iterator] | None = None,
                 slot: Callable[[str], ContextManager] = contextlib.nullcontext):
        self.reflect, self.bank_exists, self.stream = reflect, bank_exists, stream
        self.slot = slot

    def _args(self, request) -> tuple[tuple, dict]:
        """(positional arguments, keyword arguments) of ``reflect``/``stream`` for
        ``request``. Raises NotFound (no such bank) and InvalidArgument naming the field."""
        bank_id = bank_id_of(request.parent)
        if not self.bank_exists(bank_id):
            raise NotFound(f"bank {bank_id!r} not found")
        if not request.query.strip():
            raise InvalidArgument("query", "must not be empty")
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        try:
            schema = (json_format.MessageToDict(request.response_schema)
                      if request.HasField("response_schema") else None)
        except ValueError:  # a NaN or an Infinity: no JSON holds them
            raise InvalidArgument("response_schema", "numbers must be finite "
                                  "(JSON has no NaN or Infinity)") from None
        if schema is not None and not schema:
            raise InvalidArgument("response_schema", "must be a non-empty JSON schema")
        now = (ts_to_dt(request.query_timestamp, "query_timestamp")
               if request.HasField("query_timestamp") else None)
        tags = apiconv.check_tags(request.tags)
        if request.tags_match not in apiconv.TAGS_MATCH:
            raise InvalidArgument("tags_match", "unknown value")
        if request.max_tokens < 0:  # (the limits interceptor refuses it first)
            raise InvalidArgument("max_tokens", "must not be negative")
        try:  # reflect's "now" carries the caller's zone: its prompt and recalls read it
            now = wall_clock(now or datetime.now(timezone.utc), request.time_zone)
        except ValueError as e:
            raise InvalidArgument("time_zone", str(e)) from None
        return ((bank_id, request.query, request.context, apiconv.BUDGET[request.budget],
                 now, schema, tags),
                {"tags_match": apiconv.TAGS_MATCH[request.tags_match],
                 "max_tokens": request.max_tokens})

    @translate_errors
    def Reflect(self, request, context):
        with deadline.bind(call_deadline(context)):
            args, kw = self._args(request)
            with self.slot(args[0]):
                return response_to_api(self.reflect(*args, **kw))

    def StreamReflect(self, request, context):
        from services.reflect.agent import Done, TextDelta, ToolEvent
        try:
            with deadline.bind(call_deadline(context)), contextlib.ExitStack() as held:
                args, kw = self._args(request)
                held.enter_context(self.slot(args[0]))
                events = (self.stream or (lambda *a, **k: iter([Done(self.reflect(*a, **k))])))(
                    *args, **kw)
                for e in events:
                    if not context.is_active():
                        return
                    if isinstance(e, ToolEvent):
                        yield reflect_pb2.ReflectEvent(tool_call=reflect_pb2.ReflectToolCall(
                            name=e.name, query=str(e.arguments.get("query", "")),
                            results=e.results, forced=e.forced))
                    elif isinstance(e, TextDelta):
                        yield reflect_pb2.ReflectEvent(text_delta=e.text)
                    elif isinstance(e, Done):
                        yield reflect_pb2.ReflectEvent(done=response_to_api(e.reflection))
        except MnemeError as err:  # the same statuses as the unary call
            abort_for(context, err)


_POLICY = {mental_models_pb2.REFRESH_POLICY_UNSPECIFIED: "manual", mental_models_pb2.MANUAL: "manual",
           mental_models_pb2.AFTER_CONSOLIDATION: "after_consolidation",
           mental_models_pb2.EVERY_N_FACTS: "every_n_facts"}
_POLICY_PB = {"manual": mental_models_pb2.MANUAL, "after_consolidation":
              mental_models_pb2.AFTER_CONSOLIDATION, "every_n_facts": mental_models_pb2.EVERY_N_FACTS}

_MODE = {mental_models_pb2.REFRESH_MODE_UNSPECIFIED: "full", mental_models_pb2.FULL: "full",
         mental_models_pb2.DELTA: "delta"}
_MODE_PB = {"full": mental_models_pb2.FULL, "delta": mental_models_pb2.DELTA}


def mental_model_to_api(m: MentalModel, stale: bool) -> mental_models_pb2.MentalModel:
    """A :class:`~mneme.domain.MentalModel` → MentalModel (memories as names)."""
    out = mental_models_pb2.MentalModel(
        name=mental_model_name(m.bank_id, m.id), id=m.id, display_name=m.display_name,
        source_query=m.source_query, content=m.content, tags=list(m.tags),
        max_tokens=m.max_tokens, refresh_policy=_POLICY_PB.get(m.refresh_policy, 0),
        refresh_every=m.refresh_every, revision=m.revision,
        based_on=[memory_name(m.bank_id, i) for i in m.based_on], is_stale=stale,
        create_time=dt_to_ts(from_epoch(m.created_at)), update_time=dt_to_ts(from_epoch(m.updated_at)))
    if m.refreshed_at:
        out.refresh_time.CopyFrom(dt_to_ts(from_epoch(m.refreshed_at)))
    return out


def _model_from_api(m: mental_models_pb2.MentalModel, bank_id: str, model_id: str = "") -> MentalModel:
    if m.refresh_policy not in _POLICY:
        raise InvalidArgument("mental_model.refresh_policy", "not a RefreshPolicy value")
    return MentalModel(id=model_id, bank_id=bank_id, display_name=m.display_name,
                       source_query=m.source_query, content=m.content, tags=tuple(m.tags),
                       max_tokens=m.max_tokens, refresh_policy=_POLICY[m.refresh_policy],
                       refresh_every=m.refresh_every)


class MentalModelServicer(mental_models_pb2_grpc.MentalModelServiceServicer):
    """MentalModelService over :class:`services.reflect.mental_models.MentalModels`; a
    refresh (a reflection, then its write) holds ``slot(bank_id)`` as Reflect does."""

    def __init__(self, models, slot: Callable[[str], ContextManager] = contextlib.nullcontext):
        self.models, self.slot = models, slot

    def _api(self, m: MentalModel) -> mental_models_pb2.MentalModel:
        return mental_model_to_api(m, self.models.is_stale(m))

    @translate_errors
    def CreateMentalModel(self, request, context):
        bank_id = bank_id_of(request.parent)
        if not request.HasField("mental_model"):
            raise InvalidArgument("mental_model", "required")
        with deadline.bind(call_deadline(context)):
            return self._api(self.models.create(_model_from_api(request.mental_model, bank_id),
                                                remaining(context, 30.0),
                                                model_id=request.mental_model_id))

    @translate_errors
    def GetMentalModel(self, request, context):
        return self._api(self.models.get(*mental_model_of(request.name)))

    @translate_errors
    def ListMentalModels(self, request, context):
        bank_id = bank_id_of(request.parent)
        apiconv.check_tags(request.tags)
        size = paging.page_size(request.page_size)
        if request.tags_match not in apiconv.TAGS_MATCH:
            raise InvalidArgument("tags_match", "unknown value")
        # bound to the filters: the next page of other tags is not this list's (AIP-158)
        kind = ("mental-models", bank_id, list(request.tags), request.tags_match)
        after = paging.decode_token(request.page_token, kind) or ""
        found = self.models.list(bank_id, size + 1, after, tuple(request.tags),
                                 apiconv.TAGS_MATCH[request.tags_match])
        page = found[:size]
        stale = self.models.stale_ids(page)
        return mental_models_pb2.ListMentalModelsResponse(
            mental_models=[mental_model_to_api(m, m.id in stale) for m in page],
            next_page_token=paging.encode_token(kind, page[-1].id) if len(found) > size else "")

    @translate_errors
    def UpdateMentalModel(self, request, context):
        if not request.HasField("mental_model"):
            raise InvalidArgument("mental_model", "required")
        bank_id, model_id = mental_model_of(request.mental_model.name, "mental_model.name")
        with deadline.bind(call_deadline(context)):
            return self._api(self.models.update(
                _model_from_api(request.mental_model, bank_id, model_id),
                apiconv.update_paths(request.update_mask.paths, MENTAL_MODEL_FIELDS,
                                     request.mental_model),
                remaining(context, 30.0)))

    @translate_errors
    def DeleteMentalModel(self, request, context):
        self.models.delete(*mental_model_of(request.name))
        return empty_pb2.Empty()

    @translate_errors
    def ClearMentalModel(self, request, context):
        return self._api(self.models.clear(*mental_model_of(request.name)))

    @translate_errors
    def ListMentalModelRevisions(self, request, context):
        bank_id, model_id = mental_model_of(request.parent, "parent")
        size = paging.page_size(request.page_size)
        kind = ("revisions", bank_id, model_id)
        after = paging.decode_token(request.page_token, kind, int) or 0
        revs = [r for r in self.models.history(bank_id, model_id) if r.revision > after]
        page = revs[:size]
        return mental_models_pb2.ListMentalModelRevisionsResponse(revisions=[
            mental_models_pb2.MentalModelRevision(
                revision=r.revision, content=r.content, source=r.source,
                based_on=[memory_name(bank_id, i) for i in r.based_on],
                create_time=dt_to_ts(from_epoch(r.at)), mode=_MODE_PB.get(r.mode, 0))
                for r in page],
            next_page_token=paging.encode_token(kind, page[-1].revision) if len(revs) > size else "")

    @translate_errors
    def RefreshMentalModel(self, request, context):
        bank_id, model_id = mental_model_of(request.name)
        if request.budget not in apiconv.BUDGET:
            raise InvalidArgument("budget", "must be LOW, MID or HIGH")
        if request.mode not in _MODE:
            raise InvalidArgument("mode", "must be FULL or DELTA")
        with deadline.bind(call_deadline(context)), self.slot(bank_id):
            m, _ = self.models.refresh(bank_id, model_id, datetime.now(timezone.utc),
                                       apiconv.BUDGET[request.budget], dry_run=request.dry_run,
                                       mode=_MODE[request.mode])
        return self._api(m)


def register(server, servicer: ReflectServicer, models=None) -> list[str]:
    """Add ReflectService (and MentalModelService over ``models``) to ``server``."""
    reflect_pb2_grpc.add_ReflectServiceServicer_to_server(servicer, server)
    names = [reflect_pb2.DESCRIPTOR.services_by_name["ReflectService"].full_name]
    if models is not None:
        mental_models_pb2_grpc.add_MentalModelServiceServicer_to_server(
            MentalModelServicer(models, servicer.slot), server)
        names.append(mental_models_pb2.DESCRIPTOR.services_by_name["MentalModelService"].full_name)
    return names
