"""A producer refuses, at start-up, a side-channel host it cannot bind (issue #17): P advertises
that address to D, so it must be one of its own host's. End to end in tests/test_netns_pd.py."""
from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.params import compat_fingerprint
from kv_transfer.zmq_sender import KVSender

pytestmark = pytest.mark.unit


def test_sender_names_the_flag_when_the_host_is_not_local():
    compat = compat_fingerprint("m", "float32", 16, 1, 1, 8, "v")
    kv = np.zeros((2, 1024), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"cannot bind the KV side channel at tcp://203\.0\.113\.7:\* "
                                         r"\(Cannot assign requested address\): --kv-side-channel-host"):
        KVSender(kv, compat, host="203.0.113.7")  # TEST-NET-3: on no interface here; bind sends nothing


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*"])
def test_sender_refuses_a_wildcard_it_would_advertise(host):
    compat = compat_fingerprint("m", "float32", 16, 1, 1, 8, "v")
    with pytest.raises(ValueError, match="not the wildcard"):
        KVSender(np.zeros((2, 1024), dtype=np.uint8), compat, host=host)
