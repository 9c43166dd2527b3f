"""`kiln serve`: the OpenAI-compatible HTTP server (FastAPI) over the AsyncEngine."""
