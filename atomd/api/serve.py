"""`atomd serve`: its flags, and the start-up that binds the port, starts the engine core and
runs the Server (atomd/api/server.py) until SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import sys
from typing import Any

import uvloop
from aiohttp import web

from atomd.api import chat_templates
from atomd.api import limits as L
from atomd.api.http import HEAD_LIMITS, JSONErrorRunner
from atomd.api.server import PROBE_PATHS, Server, access_logger
from atomd.api.reasoning import REASONING_PARSERS
from atomd.api.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("atomd.api.serve")
SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM, in-flight requests get this long before they are cut


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from atomd.config import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (all routes but /health, /ready, /metrics, "
                        "/openapi.json)")
    g.add_argument("--admin-api-key", default=None,
                   help="the admin routes (/reset_prefix_cache, /kv_transfer/abort, /debug/*) take this key "
                        "instead of --api-key, which then opens only the client routes (the router passes "
                        "it with --engine-admin-api-key)")
    g.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get a 413")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the engine's model name)")
    g.add_argument("--engine-start-timeout-s", type=float, default=600.0,
                   help="give up when the engine core is not ready by then")
    g.add_argument("--engine-stall-timeout-s", type=float, default=60.0,
                   help="/health answers 503 while the engine core, with requests in flight, has not answered "
                        "for this long (probed every third of it), so a router takes a wedged engine out of "
                        "rotation; it must exceed the longest engine step")
    L.add_arguments(parser.add_argument_group("request limits (a request over one is a 400 naming it)"))
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log",
                   action="store_true", help="write no access log lines (vLLM's name is accepted too)")
    g.add_argument("--access-log-probes", action="store_true",
                   help="log the probes too (%s: a router asks every few seconds), which are left out by default"
                        % ", ".join(PROBE_PATHS))
    g.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default="hermes",
                   help="how tool calls are read from the model's output (chat requests with tools): hermes "
                        "(<tool_call> JSON: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3's JSON calls)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> out of chat output into reasoning_content: qwen3 (when the "
                        "output opens with <think>), deepseek_r1 (the template opened it: output starts in it)")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="a chat template (a jinja file, or the template inline) instead of the checkpoint's")
    g.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="embed: also serve /v1/embeddings (vLLM's --task embed; generation routes stay)")
    g.add_argument("--pooling-type", choices=("last", "mean"), default="last",
                   help="--task embed: an embedding is the last prompt token's final-normed hidden state, or the "
                        "mean over the prompt's tokens")
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} (the "
                        "oldest evicted first; 0: none)")
    g.add_argument("--max-background-responses", type=int, default=64,
                   help="/v1/responses with background: true running at once (a 429 past it)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (it runs in jinja's sandbox, but can loop; "
                        "off: such a request is a 400)")


def run(args: argparse.Namespace) -> int:
    from atomd.config import EngineConfig

    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    access = logging.StreamHandler(sys.stderr)  # bare JSON lines, one per request
    access.setFormatter(logging.Formatter("%(message)s"))
    access_logger.addHandler(access)
    access_logger.propagate = False
    try:
        config = EngineConfig.from_args(args)
        config.check_model_dir()
        if args.chat_template is not None:  # a bad one stops here, not at the first request
            args.chat_template = chat_templates.load_chat_template(args.chat_template)
    except ValueError as e:
        print(f"atomd serve: error: {e}", file=sys.stderr)
        return 2
    return uvloop.run(serve(config, args))


def listen_error(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use by another process; pick a free one with --port"
    return f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port"


async def serve(config: Any, args: argparse.Namespace) -> int:
    """Listen at once (so /health answers while the model loads), then start the core."""
    server = Server(config, args)
    runner = JSONErrorRunner(server.app, handler_cancellation=True, access_log=None,
                             shutdown_timeout=SHUTDOWN_TIMEOUT_S, **HEAD_LIMITS)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as e:  # the user's to fix: one line naming the flag (the trace with --debug)
        logger.debug("cannot listen on %s:%s", args.host, args.port, exc_info=True)
        await runner.cleanup()
        print(f"atomd serve: error: {listen_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(args.engine_start_timeout_s)
        print(f"atomd serve: ready at http://{args.host}:{args.port} (model {server.model_name})", flush=True)
        await stop.wait()
        return 0
    except Exception as e:  # the engine core or the tokenizer could not start
        print(f"atomd serve: failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        await server.stop(runner)
