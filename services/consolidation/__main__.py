"""`python -m services.consolidation`: run the consolidation service as its own process (distributed
topology), configured by ``MNEME_*`` variables; same as ``mneme serve consolidation``."""

from mneme.runtime.process import main_service

if __name__ == "__main__":
    main_service("consolidation")
