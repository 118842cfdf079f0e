"""extraction: turns retain requests into facts (chunking, offline or LLM extraction,
time normalisation, entity resolution, embeddings) and deletions into retractions.
Consumes ``mneme.intake.v1``; produces ``mneme.memory.v1``."""
