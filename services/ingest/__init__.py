"""ingest: the gRPC write API (banks, retain, deletions, operations). Writes go to
``mneme.intake.v1``; the catalog of banks and operations is its projection of the intake
and progress topics."""
