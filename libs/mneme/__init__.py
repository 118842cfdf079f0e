"""mneme: long-term memory for AI agents (shared package)."""
