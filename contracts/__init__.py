"""The wire contracts: what the API process, the engine, the scheduler, the KV connector and the
router must agree on or compute identically, with no dependency on any of them (msgspec, the
standard library and, for chat templates, jinja2: tests/test_architecture.py)."""
