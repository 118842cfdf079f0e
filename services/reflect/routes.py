"""reflect's routes: its API records reflections; in the distributed topology it keeps
its own bank catalog (group ``reflect-catalog``, one copy per replica) for the banks'
traits and directives."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, REFLECT
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service

SERVICE = Service(
    "reflect",
    groups=(Group("reflect-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
                  replay=True, state="replica"),),
    produces={REFLECT: (ev.ReflectionRecorded,), AUDIT: (ev.AuditRecorded,)})
