"""The OpenAI-compatible HTTP server over the engine (a second front end beside the desktop app).

server.app: the FastAPI app and its job queue; server.guard: what is refused at the door (keys, origins, sizes,
slow clients); server.schema: request bodies and error JSON; server.thread: uvicorn in a thread of this process
(the desktop app, the tests and the bench use it); cli.server: `kvboost-server`. Imports the engine's public names only.
"""
