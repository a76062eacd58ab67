"""The router's POST /kv_transfer/abort carries the legs' Authorization: an engine started
with --api-key (as the Helm chart starts every engine) answers 401 to an abort without it,
and the prefill's pinned blocks would wait for their lease to expire."""
from __future__ import annotations

import pytest
from aiohttp import web

from benchmarks.fake_engine import FakeEngine
from tests.fake_workers import Cluster, LoopThread, wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class KeyedPrefill(FakeEngine):
    """A prefill engine that, like `atomd serve --api-key KEY`, wants the key on aborts."""

    key = "Bearer sk-test"

    async def abort(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != self.key:
            return web.json_response({"error": {"message": "missing or invalid API key"}}, status=401)
        return await super().abort(request)


def test_abort_after_a_failed_decode_leg_is_authorized():
    loop = LoopThread()
    cluster = Cluster(loop, api_key="sk-test")
    cluster.prefill = [KeyedPrefill("prefill")]
    try:
        cluster.start()
        cluster.decode[0].fail_status = 500  # D fails: nobody pulls P's blocks, the router aborts them
        reply = cluster.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2},
                             headers={"Authorization": KeyedPrefill.key})
        assert reply.status == 502
        wait_until(lambda: len(cluster.prefill[0].aborts) == 1, 5, "the authorized abort")
    finally:
        cluster.stop()
        loop.close()
