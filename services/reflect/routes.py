"""reflect's routes: its API records reflections and mental-model changes; in the
distributed topology it keeps its own bank catalog (group ``reflect-catalog``, one copy
per replica) for the banks' traits, directives and mental models; group
``reflect-refresh`` runs the mental models' scheduled refreshes; group
``reflect-opinions`` forms opinions from the reflections a model answered."""

from mneme import bank_catalog
from mneme.bus import AUDIT, INTAKE, MEMORY, REFLECT
from mneme.events.v1 import events_pb2 as ev
from mneme.router import Group, Service
from services.reflect import handlers

SERVICE = Service(
    "reflect",
    groups=(Group("reflect-catalog", {INTAKE: bank_catalog.ROUTES}, distributed_only=True,
                  replay=True, state="replica"),
            # scheduled mental-model refreshes; a failed one never fails the retain
            Group("reflect-refresh", {MEMORY: {ev.FactsExtracted: handlers.on_memory_changed,
                                               ev.ObservationsChanged: handlers.on_memory_changed}},
                  secondary=(ev.FactsExtracted, ev.ObservationsChanged)),
            # opinions formed from the reflections a model answered
            Group("reflect-opinions", {REFLECT: {ev.ReflectionRecorded:
                                                 handlers.on_reflection_recorded}},
                  secondary=(ev.ReflectionRecorded,))),
    # its MentalModelService appends the models' changes to the intake topic
    produces={REFLECT: (ev.ReflectionRecorded,), INTAKE: (ev.MentalModelChanged,),
              MEMORY: (ev.OpinionsChanged,), AUDIT: (ev.AuditRecorded,)})
