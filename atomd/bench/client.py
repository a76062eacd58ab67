"""The load generator: when requests go out, how one streamed request is timed, and the loop.

Timing follows vLLM's request functions: TTFT at the first chunk that carries generated
text (a chat stream's role-only opening chunk is not a token), one ITL per later text chunk,
E2EL when the stream ends. Token counts come from the server's `usage` (we always ask for
`stream_options.include_usage`), because a chunk may hold several tokens or none.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from atomd.bench.datasets import SampleRequest, TokenSpace
from atomd.bench.metrics import RequestResult

def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds from the start. Gaps are gamma(shape=burstiness, mean=1/rate):
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more even; rate inf sends all at once."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    # Like vLLM, stretch the draw so the last request leaves at n/rate: the sum of n random
    # gaps is off by a few percent, which would otherwise show up as throughput noise per seed.
    return times * (n / request_rate / times[-1])


@dataclass
class Endpoint:
    """Where and how every request of a run is sent."""

    url: str
    model: str
    chat: bool
    ignore_eos: bool = True
    headers: dict[str, str] = field(default_factory=dict)

    def payload(self, req: SampleRequest) -> dict:
        body = {"model": self.model, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:  # a vLLM extension: only sent when wanted, so plain OpenAI servers accept the rest
            body["ignore_eos"] = True
        if self.chat:
            body.update(messages=[{"role": "user", "content": req.prompt}],
                        max_completion_tokens=req.expected_output_len)
        else:
            body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
        return body


def chunk_text(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def read_stream(resp: aiohttp.ClientResponse, result: RequestResult, sent: float, chat: bool) -> dict:
    """Fill ttft/itl/generated_text from the SSE body; return the last `usage` seen ({} if none)."""
    usage: dict = {}
    last = sent
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, `: ping` comments, `event:` lines
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"error event in stream: {obj['error']}")
        if text := chunk_text(obj, chat):
            now = time.perf_counter()
            if result.generated_text:
                result.itl.append(now - last)
            else:
                result.ttft = now - sent
            last = now
            result.generated_text += text
        usage = obj.get("usage") or usage
    return usage


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, req: SampleRequest,
                       space: TokenSpace, t0: float) -> RequestResult:
    """One streamed request, timed; every failure is recorded in `error`, never raised."""
    sent = time.perf_counter()
    # A failed request keeps its intended prompt length in `input_lens`, as vLLM records it.
    result = RequestResult(start_time=sent - t0, prompt_len=req.prompt_len or 0)
    try:
        async with session.post(endpoint.url, json=endpoint.payload(req), headers=endpoint.headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            usage = await read_stream(resp, result, sent, endpoint.chat)
        result.latency = time.perf_counter() - sent
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not result.generated_text:
        result.error = "stream ended without any generated text"
        return result
    result.success = True
    if req.prompt_len is None:
        result.prompt_len = int(usage.get("prompt_tokens") or 0)
    result.output_len = int(usage.get("completion_tokens") or space.count(result.generated_text)
                            or len(result.itl) + 1)
    return result


async def discover_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    """The first model of GET /v1/models (what `--model` defaults to)."""
    try:
        async with session.get(base_url + "/v1/models", headers=headers) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {body}")
            return body["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"model: cannot read GET {base_url}/v1/models ({e}); pass --model") from None


async def run_load(endpoint: Endpoint, requests: list[SampleRequest], arrivals: np.ndarray, space: TokenSpace,
                   max_concurrency: int | None, timeout_s: float, progress=None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (waiting for a slot when `max_concurrency` is hit);
    return the results in request order and the benchmark duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()

        async def one(req: SampleRequest) -> RequestResult:
            if limit is None:
                result = await send_request(session, endpoint, req, space, t0)
            else:
                async with limit:
                    result = await send_request(session, endpoint, req, space, t0)
            if progress is not None:
                progress.update(1)
            return result

        tasks = []
        for req, at in zip(requests, arrivals):
            if (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0
