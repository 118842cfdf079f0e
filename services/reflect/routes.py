"""reflect's routes: its API records reflections and mental-model changes; in the
distributed topology it keeps its own bank catalog (group ``reflect-catalog``, one copy
per replica) for the banks' traits, directives and mental models."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, REFLECT
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service

SERVICE = Service(
    "reflect",
    groups=(Group("reflect-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
                  replay=True, state="replica"),),
    # its MentalModelService appends the models' changes to the intake topic
    produces={REFLECT: (ev.ReflectionRecorded,), INTAKE: (ev.MentalModelChanged,),
              AUDIT: (ev.AuditRecorded,)})
