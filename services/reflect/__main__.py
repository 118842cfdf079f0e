"""`python -m services.reflect`: run the reflect service as its own process (distributed
topology), configured by ``MNEME_*`` variables; same as ``mneme serve reflect``."""

from mneme.runtime.process import main_service

if __name__ == "__main__":
    main_service("reflect")
