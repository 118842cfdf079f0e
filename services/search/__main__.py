"""`python -m services.search`: run the search service as its own process (distributed
topology), configured by ``MNEME_*`` variables; same as ``mneme serve search``."""

from mneme.runtime.process import main_service

if __name__ == "__main__":
    main_service("search")
