"""The API process side: HTTP server, request protocol, renderers, the client of the engine core.

Never imports torch (tests/test_architecture.py)."""
