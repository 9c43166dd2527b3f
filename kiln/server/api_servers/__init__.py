"""Several API processes over one engine process: `kiln serve --api-server-count N` (vLLM's
name). One API process (uvicorn + FastAPI) spends ~100 us of CPU per streamed token, so at
15-17k tok/s it needs a core of its own; N of them share the load.

`launcher.py` binds the port, starts the engine process and the N API processes, forwards
signals and ends the server when one part fails; `worker.py` is one API process.
"""
