"""consolidation: observation decisions (consumes ``mneme.memory.v1`` and
``mneme.intake.v1``, produces ``ObservationsChanged`` on ``mneme.memory.v1``).

* :mod:`.engine` — offline decisions (embedding similarity, entity overlap), near-duplicate
  reconciliation, scopes; pure functions over event messages.
* :mod:`.llm` — decisions through the LLM gateway (operation "consolidation").
* :mod:`.store` — the service's own projection (facts seen, observation states), rebuilt
  from the log by ``mneme replay``.
* :mod:`.handlers` — the consumer: event → decisions → ObservationsChanged.

Search projects ObservationsChanged into the vector store (``services.search.observations``)
and serves the observation read API."""
