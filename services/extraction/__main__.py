"""`python -m services.extraction`: run the extraction service as its own process (distributed
topology), configured by ``MNEME_*`` variables; same as ``mneme serve extraction``."""

from mneme.runtime.process import main_service

if __name__ == "__main__":
    main_service("extraction")
