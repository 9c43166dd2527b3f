"""The engine core in its own process: scheduler, executor and model behind ZMQ, so the API
process's interpreter lock serves HTTP, JSON and SSE alone. `EngineClient` (client.py) has the
AsyncEngine's surface; `process.py` is the engine process; `messages.py` what crosses between."""
