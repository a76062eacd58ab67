"""`python -m router` / `atomd-router`: the router on one host:port.

Every OpenAI request runs as a prefill leg on a --prefill engine and a decode leg on a
--decode engine, whose answer is relayed to the client; with only colocated --worker
engines (or no prefill/decode pair in rotation) it runs as one leg on a worker."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import logging
import signal
import sys

from kv_transfer.trust import load_secret
from router.adaptive import PD_MODES
from router.app import Router, RouterConfig
from router.discovery import Resolver
from router.policies import POLICIES

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose errors are one line (as atomd/cli.py's: argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv: list[str] | None) -> RouterConfig:
    return parse_command_line(argv)[0]


def parse_command_line(argv: list[str] | None) -> tuple[RouterConfig, bool]:
    """The router's configuration and --debug (the command line's, not the router's)."""
    d = RouterConfig()
    p = OneLineErrors(prog="atomd-router", description=__doc__,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    workers = p.add_argument_group("workers")
    workers.add_argument("--prefill", action="append", default=[], metavar="URL",
                         help="a prefill engine's base URL (repeatable; more can join via POST /workers)")
    workers.add_argument("--decode", action="append", default=[], metavar="URL",
                         help="a decode engine's base URL (repeatable)")
    workers.add_argument("--worker", action="append", default=[], metavar="URL",
                         help="a colocated engine's base URL (--kv-role both; repeatable): one leg per request, "
                              "load-balanced with the decode policy's choice")
    workers.add_argument("--prefill-dns", action="append", default=[], metavar="NAME:PORT",
                         help="a DNS name whose every address is a prefill engine at PORT, re-resolved every "
                              "--dns-refresh-s (repeatable; e.g. a Kubernetes headless Service)")
    workers.add_argument("--decode-dns", action="append", default=[], metavar="NAME:PORT",
                         help="the same for decode engines (repeatable)")
    workers.add_argument("--dns-refresh-s", type=float, default=d.dns_refresh_s,
                         help="seconds between resolutions of the --prefill-dns / --decode-dns names")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    pol = p.add_argument_group("policies")
    pol.add_argument("--policy", default=d.policy, choices=sorted(POLICIES),
                     help="how a worker of each role is picked (--prefill-policy / --decode-policy override it)")
    pol.add_argument("--prefill-policy", default=None, choices=sorted(POLICIES), help="the prefill role's policy")
    pol.add_argument("--decode-policy", default=None, choices=sorted(POLICIES),
                     help="the decode role's (and colocated workers') policy")
    pol.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                     help="cache_aware: the share of the prompt a worker must have seen to get it")
    pol.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                     help="cache_aware: load balance instead when max - min legs in flight exceed this ...")
    pol.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                     help="... and max > min x this")
    pol.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                     help="cache_aware: characters kept per worker in the prefix tree")
    pol.add_argument("--eviction-interval-s", type=float, default=d.eviction_interval_s,
                     help="cache_aware: seconds between prefix-tree evictions")
    pol.add_argument("--kv-load-weight", type=float, default=d.kv_load_weight,
                     help="kv_aware: cost of one prompt token in flight relative to one token not cached")
    pol.add_argument("--kv-events-stale-s", type=float, default=d.kv_events_stale_s,
                     help="kv_aware: a DP rank whose KV events are silent this long scores an empty cache")
    pol.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="kv_aware: the model's tokenizer (directory with tokenizer.json), to hash prompts as "
                          "the engines do (default: the one an engine on this host reports)")
    pol.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                     help="kv_aware: the chat template the engines run with --chat-template (a jinja file or the "
                          "template inline), to render chat prompts as they do (default: the model's)")
    pol.add_argument("--session-header", default=d.session_header,
                     help="session / consistent_hash: the header naming a session (else the body's `user`)")
    pol.add_argument("--session-ttl-s", type=float, default=d.session_ttl_s,
                     help="session: an idle session's worker is forgotten after this long")
    rel = p.add_argument_group("timeouts, retries, limits")
    rel.add_argument("--health-interval-s", type=float, default=d.health_interval_s,
                     help="seconds between health checks of every worker")
    rel.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                     help="limit on the prefill leg, and on the silence between the decode leg's bytes")
    rel.add_argument("--prefill-timeout-s", type=float, default=None,
                     help="limit on one prefill try, after which it is retried elsewhere "
                          "(default: --request-timeout-s)")
    rel.add_argument("--total-timeout-s", type=float, default=None,
                     help="limit on a whole request once admitted, both legs and the stream (default: none)")
    rel.add_argument("--max-prefill-tries", type=int, default=d.max_prefill_tries,
                     help="prefill tries per request (on other prefill workers) before it fails")
    rel.add_argument("--retry-backoff-s", type=float, default=d.retry_backoff_s,
                     help="base of the full-jitter exponential backoff between prefill tries")
    rel.add_argument("--strict-pd", action="store_true",
                     help="the alias of --pd-mode strict")
    pdm = p.add_argument_group("disaggregation")
    pdm.add_argument("--pd-mode", default=d.pd_mode, choices=PD_MODES,
                     help="always: two legs per request (falling back to one when P keeps no KV or none is in "
                          "rotation); adaptive: per request, two legs or a local prefill on the chosen decode "
                          "engine, from the uncached prompt, the prefill queues and the learnt prefill rates and "
                          "transfer costs; strict: always two legs with KV moved, every fallback an error")
    pdm.add_argument("--local-prefill-max-tokens", type=int, default=d.local_prefill_max_tokens,
                     help="adaptive: a prompt with at most this many tokens the decode engine has not cached "
                          "prefills there (pair with the decode engines' --max-local-prefill-tokens-per-step)")
    pdm.add_argument("--local-prefill-max-itl-ms", type=float, default=d.local_prefill_max_itl_ms,
                     help="adaptive: a long prompt goes to P even when P is backed up while the gap between the "
                          "tokens of the decode engine's streams (a moving average of the events the router relays) "
                          "is at least this many ms; short prompts still prefill there. Set it to the TPOT SLO "
                          "minus the engines' --max-local-prefill-ms-per-step (0: no bound)")
    rel.add_argument("--breaker-failures", type=int, default=d.breaker_failures,
                     help="consecutive worker faults (connection errors, timeouts, 502-504, broken answers; a 4xx "
                          "or a 500 only when another worker then serves the request) that open its breaker")
    rel.add_argument("--breaker-cooldown-s", type=float, default=d.breaker_cooldown_s,
                     help="seconds an open breaker refuses traffic before one trial request")
    rel.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                     help="requests routed at once (0: no cap; a completions request of several prompts counts "
                          "one per prompt); more wait in a queue, lower `priority` first, then arrival")
    rel.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                     help="requests waiting for a slot; beyond it a request gets 429 + Retry-After")
    rel.add_argument("--queue-timeout-s", type=float, default=d.queue_timeout_s,
                     help="longest wait for a slot before 429")
    rel.add_argument("--retry-after-s", type=int, default=d.retry_after_s,
                     help="the Retry-After a 429 carries")
    rel.add_argument("--max-prompts", type=int, default=d.max_prompts,
                     help="most prompts in one completions request (each is relayed as its own request); "
                          "more is a 400")
    rel.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                     help="a bigger request body is refused with 413")
    cli = p.add_argument_group("client connections (what a client owes the router; past it: 408 and close)")
    cli.add_argument("--client-idle-timeout-s", type=float, default=d.client_idle_timeout_s,
                     help="a kept-alive connection with no request (or not reading its answers) this long is closed")
    cli.add_argument("--client-header-timeout-s", type=float, default=d.client_header_timeout_s,
                     help="a request head must arrive whole within this, from its first byte, however slowly it "
                          "trickles")
    cli.add_argument("--client-body-timeout-s", type=float, default=d.client_body_timeout_s,
                     help="a request body must arrive whole within this, from the end of its head")
    cli.add_argument("--max-pending-body-bytes", type=int, default=d.max_pending_body_bytes,
                     help="request bodies still arriving, all connections together; past it a connection's "
                          "upload is refused with 503")
    rel.add_argument("--max-upstream-event-bytes", type=int, default=d.max_upstream_event_bytes,
                     help="a longer server-sent event from a worker ends that stream with an error event")
    sec = p.add_argument_group("security")
    sec.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` "
                     "(all routes but /health, /ready, /metrics, /dashboard); forwarded to the engines and sent on "
                     "the router's own GET /kv_transfer_info; /metrics shows its per-worker series (engine URLs) only "
                     "to the key /workers takes")
    sec.add_argument("--admin-api-key", default=None,
                     help="a separate key for GET/POST/DELETE /workers and /dashboard/state (client keys do not "
                          "open them); default: those routes take the --api-key")
    sec.add_argument("--engine-admin-api-key", default=None,
                     help="the engines' --admin-api-key: sent on the router's POST /kv_transfer/abort "
                          "(default: the client's Authorization, which works while engines have no admin key)")
    sec.add_argument("--kv-params-secret-file", default=None, metavar="PATH",
                     help="file holding the secret shared with the engines; the router signs the "
                          "kv_transfer_params it sends decode engines with it (default: $ATOMD_KV_PARAMS_SECRET)")
    p.add_argument("--debug", action="store_true",
                   help="log at debug level and show the traceback of a start-up error")
    args = vars(p.parse_args(argv))
    debug = args.pop("debug")
    try:
        load_secret(path=args["kv_params_secret_file"])  # an unreadable or empty secret: an error now
        return RouterConfig(**args), debug
    except ValueError as e:
        p.error(str(e))


async def serve(config: RouterConfig, resolver: Resolver | None = None) -> None:
    router = Router(config, resolver)
    try:
        url = await router.start()
    except BaseException as e:
        await router.stop()
        bind = isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
        if not bind:
            raise
        # cannot listen: the user's to fix, one line naming the flag (the trace with --debug)
        logging.getLogger("atomd.router").debug("cannot listen", exc_info=True)
        print("atomd-router: error: " + (
            f"port {config.port} on {config.host} is in use by another process; pick a free one with --port"
            if e.errno == errno.EADDRINUSE else
            f"cannot listen on {config.host}:{config.port} ({e.strerror}); check --host and --port"), file=sys.stderr)
        raise SystemExit(2) from None
    print(f"atomd-router: ready at {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop()


def return_big_buffers_to_the_os() -> None:
    """glibc raises its mmap threshold to the size of a big buffer once it is freed (up to
    32 MiB); buffers of that size then come from the heap, which keeps them in RSS after
    they are freed: a hostile client's 15 MB upload would leave its memory behind (issue
    #42). A fixed 1 MiB threshold keeps every big buffer (a request body, an SSE event) in
    its own mapping, returned to the OS when freed. Not glibc: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None, resolver: Resolver | None = None) -> int:
    """`resolver`: how --prefill-dns / --decode-dns names are looked up (tests map them)."""
    config, debug = parse_command_line(argv)
    return_big_buffers_to_the_os()
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # uvloop is optional: plain asyncio works, a little slower
        asyncio.run(serve(config, resolver))
    else:
        uvloop.run(serve(config, resolver))
    return 0


if __name__ == "__main__":
    sys.exit(main())
