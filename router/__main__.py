"""`python -m router` / `atomd-router`: the PD router on one host:port.

Every OpenAI request runs as a prefill leg on a --prefill engine and a decode leg on a
--decode engine; the decode engine's answer is relayed to the client."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kv_transfer.trust import load_secret
from router.app import Router, RouterConfig
from router.discovery import Resolver
from router.policies import POLICIES


def parse_args(argv: list[str] | None) -> RouterConfig:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="atomd-router", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill engine's base URL (repeatable; more can join via POST /workers)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode engine's base URL (repeatable)")
    p.add_argument("--prefill-dns", action="append", default=[], metavar="NAME:PORT",
                   help="a DNS name whose every address is a prefill engine at PORT, re-resolved every "
                        "--dns-refresh-s (repeatable; e.g. a Kubernetes headless Service)")
    p.add_argument("--decode-dns", action="append", default=[], metavar="NAME:PORT",
                   help="the same for decode engines (repeatable)")
    p.add_argument("--dns-refresh-s", type=float, default=d.dns_refresh_s,
                   help="seconds between resolutions of the --prefill-dns / --decode-dns names")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--policy", default=d.policy, choices=sorted(POLICIES),
                   help="how a worker of each role is picked")
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s,
                   help="seconds between health checks of every worker")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="limit on the prefill leg, and on the silence between the decode leg's bytes")
    p.add_argument("--breaker-failures", type=int, default=d.breaker_failures,
                   help="consecutive failures that open a worker's circuit breaker")
    p.add_argument("--breaker-cooldown-s", type=float, default=d.breaker_cooldown_s,
                   help="seconds an open breaker refuses traffic before one trial request")
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` "
                   "(all routes but /health, /ready, /metrics); forwarded to the engines")
    p.add_argument("--kv-params-secret-file", default=None, metavar="PATH",
                   help="file holding the secret shared with the engines; the router signs the "
                        "kv_transfer_params it sends decode engines with it (default: $ATOMD_KV_PARAMS_SECRET)")
    args = p.parse_args(argv)
    try:
        load_secret(path=args.kv_params_secret_file)  # an unreadable or empty secret: an error now
        return RouterConfig(**vars(args))
    except ValueError as e:
        p.error(str(e))


async def serve(config: RouterConfig, resolver: Resolver | None = None) -> None:
    router = Router(config, resolver)
    url = await router.start()
    print(f"atomd-router: ready at {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop()


def main(argv: list[str] | None = None, resolver: Resolver | None = None) -> int:
    """`resolver`: how --prefill-dns / --decode-dns names are looked up (tests map them)."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # uvloop is optional: plain asyncio works, a little slower
        asyncio.run(serve(config, resolver))
    else:
        uvloop.run(serve(config, resolver))
    return 0


if __name__ == "__main__":
    sys.exit(main())
