"""The OpenAI-compatible HTTP server over the engine (a second front end beside the desktop app).

server.app: the FastAPI app, its job queue and the client deadlines; server.schema: request bodies and error
JSON; server.thread: uvicorn in a thread of this process (the desktop app, the tests and the bench use it);
server.cli: `kvboost-server`. Imports the engine's public names only.
"""
