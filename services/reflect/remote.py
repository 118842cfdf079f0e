"""reflect → search over gRPC: a ``recall`` function with the in-process signature
(``RecallQuery -> RecallOutcome``) that calls search's RecallService, for the
distributed topology (``MNEME_SEARCH_ADDRESS``; TLS/mTLS from ``MNEME_CLIENT_TLS_*``)."""

from __future__ import annotations

import grpc

from mneme.deadline import current as current_deadline
from mneme.domain import EntityRef, Fact, RecallOutcome, RecallQuery, Scored, TimeWindow
from mneme.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from mneme.grpc_util import dt_to_ts, ts_to_dt
from mneme.v1 import recall_pb2, recall_pb2_grpc, resources_pb2

_BUDGET = {"low": recall_pb2.LOW, "mid": recall_pb2.MID, "high": recall_pb2.HIGH}
_TYPE = {resources_pb2.WORLD: "world", resources_pb2.EXPERIENCE: "experience",
         resources_pb2.OBSERVATION: "observation", resources_pb2.OPINION: "opinion"}
_TYPE_PB = {v: k for k, v in _TYPE.items()}
# tags_match by name (the API's enum; "any" is its default)
_MATCH_PB = {"any": recall_pb2.ANY, "all": recall_pb2.ALL, "any_strict": recall_pb2.ANY_STRICT,
             "all_strict": recall_pb2.ALL_STRICT, "exact": recall_pb2.EXACT}
_ARMS = ("semantic", "keyword", "graph", "temporal")


def memory_from_api(bank_id: str, m: resources_pb2.Memory) -> Fact:
    """API Memory → domain Fact (no embedding or links: the API does not carry them)."""
    return Fact(id=m.id, bank_id=bank_id, text=m.text, fact_type=_TYPE.get(m.fact_type, "world"),
                context=m.context, occurred_start=ts_to_dt(m.occurred_start),
                occurred_end=ts_to_dt(m.occurred_end), mentioned_at=ts_to_dt(m.mentioned_at),
                tags=tuple(m.tags), metadata=dict(m.metadata), document_id=m.document_id,
                chunk_id=m.chunk_id,
                entities=[EntityRef(e.id, e.name, e.label) for e in m.entities])


class RemoteRecall:
    """Calls search's RecallService at ``address`` (host:port). Maps NOT_FOUND →
    NotFound, INVALID_ARGUMENT → InvalidArgument, DEADLINE_EXCEEDED → DeadlineExceeded,
    anything else (search down) → Unavailable. ``timeout``: seconds per call. ``tls``: a
    :class:`mneme.grpc_util.ClientTLS` (reflect's client certificate for an mtls search;
    re-read when the files change), None for plaintext."""

    def __init__(self, address: str, timeout: float = 30.0, tls=None) -> None:
        from mneme.client import api_channel
        # MNEME_API_KEY: reflect's own key for search when search checks keys.
        self.channel = api_channel(address, tls=tls)
        self.stub = recall_pb2_grpc.RecallServiceStub(self.channel)
        self.timeout = timeout

    def __call__(self, q: RecallQuery) -> RecallOutcome:
        f = q.filters
        req = recall_pb2.RecallRequest(
            parent=f"banks/{q.bank_id}", query=q.query, max_tokens=q.max_tokens,
            budget=_BUDGET[q.budget], query_timestamp=dt_to_ts(q.query_timestamp),
            time_zone=q.time_zone,
            tags=list(f.tags) if f else [],
            # observations for search_observations; the tag scope of a scoped reflect
            types=[_TYPE_PB[t] for t in (f.types if f else ()) if t in _TYPE_PB],
            tags_match=_MATCH_PB.get(f.tags_match, recall_pb2.ANY) if f else recall_pb2.ANY)
        try:
            # The caller's deadline bounds the hop to search too.
            left = (q.deadline or current_deadline()).remaining()
            resp = self.stub.Recall(req, timeout=self.timeout if left is None
                                    else min(self.timeout, max(left, 0.001)))
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(e.details()) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument("query", e.details()) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(e.details()) from None
            raise Unavailable(f"search: {code.name}: {e.details()}") from None
        results = []
        for r in resp.results:
            s = r.scores
            results.append(Scored(
                fact=memory_from_api(q.bank_id, r.memory),
                scores={a: getattr(s, a) for a in _ARMS if getattr(s, a)},
                ranks={a: getattr(s, f"{a}_rank") for a in _ARMS if getattr(s, f"{a}_rank")},
                rrf=s.rrf, boost=s.boost, final=s.final, tokens=r.tokens))
        window = None
        if resp.HasField("query_time_range"):
            window = TimeWindow(ts_to_dt(resp.query_time_range.start),
                                ts_to_dt(resp.query_time_range.end))
        return RecallOutcome(results=results, total_tokens=resp.total_tokens, time_window=window)

    def ping(self) -> bool:
        """True when search's channel connects within a second."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=1.0)
            return True
        except grpc.FutureTimeoutError:
            return False

    def close(self) -> None:
        self.channel.close()
