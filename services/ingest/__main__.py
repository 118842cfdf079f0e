"""`python -m services.ingest`: run the ingest service as its own process (distributed
topology), configured by ``MNEME_*`` variables; same as ``mneme serve ingest``."""

from mneme.runtime.process import main_service

if __name__ == "__main__":
    main_service("ingest")
