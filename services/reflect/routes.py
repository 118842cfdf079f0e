"""reflect's routes: no consumer group; its API records reflections."""

from mneme.bus import AUDIT, REFLECT
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Service

SERVICE = Service("reflect", produces={REFLECT: (ev.ReflectionRecorded,),
                                       AUDIT: (ev.AuditRecorded,)})
