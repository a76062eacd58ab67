"""`atomd run-batch -i in.jsonl -o out.jsonl`: OpenAI's batch file format, as `vllm run-batch`.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with `url` one of
/v1/completions, /v1/chat/completions, /v1/embeddings (with --task embed), /v1/responses.
The engine and the server start in this process (every `atomd serve` flag applies; they
listen on a free port of 127.0.0.1 only), the lines are sent to it, up to
--max-concurrent-lines at once, through the same routes a client reaches, and each answer
is written as `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}` in input order: `error` is null for a 200, else `{"code", "message"}` from the
answer's OpenAI error (the request was refused; the file goes on). A line that is not such
an object (not JSON, an unknown url, a stream) gets `response: null` and an `error` with
code `invalid_line`. A progress bar counts the lines on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from typing import Any

import aiohttp
import uvloop
from aiohttp import web
from tqdm import tqdm

from atomd.api import serve as serve_cmd

logger = logging.getLogger("atomd.api.run_batch")
URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
MAX_LINE_BYTES = 16 << 20  # as --max-request-body-bytes' default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch file (JSON lines)")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go (JSON lines, input order)")
    parser.add_argument("--max-concurrent-lines", type=int, default=64,
                        help="lines in flight at once (the engine batches them)")
    serve_cmd.add_arguments(parser)  # the engine's and the server's flags (--host / --port are not used)


def line_error(custom_id: Any, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_line", "message": message}}


def parse_line(text: str, number: int) -> tuple[dict | None, dict | None]:
    """(the request, None) or (None, the line's error output)."""
    try:
        line = json.loads(text)
    except ValueError as e:
        return None, line_error(None, f"line {number}: not JSON: {e}")
    if not isinstance(line, dict):
        return None, line_error(None, f"line {number}: not a JSON object")
    custom_id = line.get("custom_id")
    if line.get("method", "POST") != "POST":
        return None, line_error(custom_id, f"line {number}: method must be POST")
    if line.get("url") not in URLS:
        return None, line_error(custom_id, f"line {number}: url must be one of {', '.join(URLS)}")
    if not isinstance(line.get("body"), dict):
        return None, line_error(custom_id, f"line {number}: body must be a JSON object")
    if line["body"].get("stream"):
        return None, line_error(custom_id, f"line {number}: a batch line cannot stream")
    return line, None


async def answer(session: aiohttp.ClientSession, base: str, line: dict) -> dict[str, Any]:
    async with session.post(base + line["url"], json=line["body"]) as resp:
        body = await resp.json(content_type=None)
        out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.get("custom_id"),
               "response": {"status_code": resp.status, "request_id": resp.headers.get("X-Request-Id"), "body": body},
               "error": None}
    if resp.status != 200:
        error = body.get("error") if isinstance(body, dict) else None
        error = error if isinstance(error, dict) else {}
        out["error"] = {"code": error.get("code") or str(resp.status), "message": error.get("message") or str(body)}
    return out


async def run_file(args: argparse.Namespace, base: str) -> tuple[int, int]:
    """Every line of the input answered into the output, in order: (lines, errors)."""
    with open(args.input_file, encoding="utf-8") as f:
        texts = [t for t in f.read().splitlines() if t.strip()]
    slots = asyncio.Semaphore(args.max_concurrent_lines)
    timeout = aiohttp.ClientTimeout(total=None)
    bar = tqdm(total=len(texts), desc="run-batch", unit="line", file=sys.stderr)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(number: int, text: str) -> dict[str, Any]:
            line, error = parse_line(text, number) if len(text) <= MAX_LINE_BYTES else \
                (None, line_error(None, f"line {number}: longer than {MAX_LINE_BYTES} bytes"))
            if line is not None:
                async with slots:
                    try:
                        error = await answer(session, base, line)
                    except (aiohttp.ClientError, ValueError) as e:
                        error = line_error(line.get("custom_id"), f"line {number}: no answer: {e}")
            bar.update(1)
            return error

        outputs = await asyncio.gather(*(one(i + 1, t) for i, t in enumerate(texts)))
    bar.close()
    with open(args.output_file, "w", encoding="utf-8") as f:
        for out in outputs:
            f.write(json.dumps(out) + "\n")
    return len(outputs), sum(out["error"] is not None for out in outputs)


async def run_batch(config: Any, args: argparse.Namespace) -> int:
    from atomd.api.http import HEAD_LIMITS, JSONErrorRunner
    from atomd.api.server import Server

    args.disable_access_log = True
    server = Server(config, args)
    runner = JSONErrorRunner(server.app, handler_cancellation=True, access_log=None, **HEAD_LIMITS)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        await server.start(args.engine_start_timeout_s)
        lines, errors = await run_file(args, f"http://127.0.0.1:{port}")
        print(f"atomd run-batch: {lines} lines, {errors} with an error, written to {args.output_file}",
              file=sys.stderr)
        return 0
    finally:
        await server.stop(runner)


def run(args: argparse.Namespace) -> int:
    from atomd.api import chat_templates
    from atomd.config import EngineConfig

    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    open(args.input_file, encoding="utf-8").close()  # a missing file: one line before the model loads
    try:
        config = EngineConfig.from_args(args)
        config.check_model_dir()
        if args.chat_template is not None:
            args.chat_template = chat_templates.load_chat_template(args.chat_template)
    except ValueError as e:
        print(f"atomd run-batch: error: {e}", file=sys.stderr)
        return 2
    return uvloop.run(run_batch(config, args))
