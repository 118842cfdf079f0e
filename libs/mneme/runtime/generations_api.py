"""GenerationService: replays of a process's own projections into new generations
(:class:`mneme.runtime.live_replay.LiveReplay`), served by every process that holds such
state -- search (its stores; embedded, consolidation's observations with them) and, in
the distributed topology, each consolidation replica (its observation projection)."""

from __future__ import annotations

from google.protobuf import empty_pb2

from mneme.errors import FailedPrecondition, NotFound
from mneme.grpc_util import translate_errors
from mneme.names import generation_of
from mneme.paging import decode_token, encode_token, page_size
from mneme.v1 import generations_pb2, generations_pb2_grpc


class GenerationServicer(generations_pb2_grpc.GenerationServiceServicer):
    """GenerationService over ``replay`` (a :class:`mneme.runtime.live_replay.LiveReplay`:
    the replay of this process's projections into new generations)."""

    def __init__(self, replay) -> None:
        self.replay = replay

    @translate_errors
    def CreateGeneration(self, request, context):
        try:
            return generation_to_api(self.replay.start(force=request.force))
        except RuntimeError as e:  # one replay at a time
            raise FailedPrecondition(str(e)) from None

    @translate_errors
    def GetGeneration(self, request, context):
        g = generation_of(request.name)
        rec = self.replay.generations.get(g)
        if rec is None:
            raise NotFound(f"generation {g} not found")
        return generation_to_api(rec)

    @translate_errors
    def ListGenerations(self, request, context):
        size = page_size(request.page_size)
        # keyset: the token holds the last generation served (oldest first)
        after = decode_token(request.page_token, "generations", int)
        gens = [g for g in self.replay.generations.list() if after is None or g.generation > after]
        page = gens[:size]
        return generations_pb2.ListGenerationsResponse(
            generations=[generation_to_api(g) for g in page],
            next_page_token=encode_token("generations", page[-1].generation)
            if len(gens) > size else "")

    @translate_errors
    def DeleteGeneration(self, request, context):
        g = generation_of(request.name)
        try:
            self.replay.drop(g)
        except KeyError:
            raise NotFound(f"generation {g} not found") from None
        except ValueError as e:  # the live one
            raise FailedPrecondition(str(e)) from None
        return empty_pb2.Empty()


def generation_to_api(g) -> generations_pb2.Generation:
    """A :class:`mneme.generations.Generation` record as the API message."""
    msg = generations_pb2.Generation(
        name=f"generations/{g.generation}", generation=g.generation,
        state=generations_pb2.Generation.State.Value(g.state), records_done=g.records_done,
        records_total=g.records_total, error=g.error,
        check=generations_pb2.GenerationCheck(**{k: v for k, v in g.check.items()
                                                 if k in _CHECK_FIELDS}))
    msg.create_time.FromSeconds(int(g.create_time))
    msg.update_time.FromSeconds(int(g.update_time))
    return msg


_CHECK_FIELDS = ("banks", "units", "recalls", "agreement", "problems", "gained", "moving")


def register(server, servicer: GenerationServicer) -> list[str]:
    """Add ``servicer`` to ``server``; returns the service names (for health)."""
    generations_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    return [generations_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]
