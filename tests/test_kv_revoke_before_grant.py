"""An abort that overtakes the prefill it gives up (issue #18, found by tests/test_load_pd.py).

A client that hangs up while P computes its prompt makes the router POST
/kv_transfer/abort at once; under load that abort can reach P's engine before the prefill
finishes and grants the transfer. Sender.revoke of an id not granted yet must be
remembered, so the later grant is refused (the connector then frees the blocks at once)
instead of pinning the blocks until the lease expires (seen: ~1-2% of early disconnects
under 1000 concurrent clients, each pinning its blocks for the 30 s lease).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kv_transfer.params import compat_fingerprint
from tests.kv_backends import BACKENDS, make_receiver, make_sender, require_backend

COMPAT = compat_fingerprint("test-model", "float32", 16, 2, 2, 8, "0.1.0")
TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture(params=BACKENDS)
def sender(request):
    require_backend(request.param)
    s = make_sender(request.param, np.zeros((16, 1024), dtype=np.uint8), COMPAT)
    yield request.param, s
    s.close()


@pytest.mark.unit
def test_revoke_before_grant_refuses_the_grant(sender):
    backend, s = sender
    assert s.revoke("late") is False  # nothing live yet: the answer is unchanged
    with pytest.raises(ValueError):
        s.grant("late", [1, 2], TOKEN, lease_s=30)
    assert s.stats().blocks_pinned == 0
    # a revoke repeated, or of a released id, stays False and changes nothing
    assert s.revoke("late") is False
    s.grant("other", [3], TOKEN, lease_s=30)
    assert s.revoke("other") is True and s.revoke("other") is False


@pytest.mark.unit
def test_pull_of_an_id_revoked_before_grant_is_refused(sender):
    backend, s = sender
    dst = np.full((16, 1024), 0xA5, dtype=np.uint8)
    receiver = make_receiver(backend, dst, COMPAT, heartbeat_s=0.05)
    try:
        s.revoke("gone")
        receiver.start_pull("gone", *s.address, TOKEN, [1], [1], timeout_s=10)
        deadline = time.monotonic() + 10
        failed = []
        while not failed and time.monotonic() < deadline:
            _, failed = receiver.take_finished()
            time.sleep(0.005)
        assert failed == [("gone", "revoked")]
        assert (dst == 0xA5).all()
    finally:
        receiver.close()
