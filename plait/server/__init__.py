"""OpenAI-compatible HTTP server (`plait serve`), its protocol, metrics and load generator.

Importing this package stays light: the CLI builds every parser from plait.server.flags, and the
server modules (FastAPI, uvicorn, ZMQ) load only when a server or a benchmark runs.
"""
