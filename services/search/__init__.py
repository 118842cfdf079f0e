"""search: projects ``mneme.memory.v1`` into the vector, text and graph stores, reports
progress on ``mneme.progress.v1``, and serves Recall and the memory read API."""
