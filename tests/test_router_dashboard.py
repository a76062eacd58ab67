"""The router's /dashboard in headless Chromium (Debian's `chromium` package).

The page loads, shows every worker, and updates after a request without a reload (it
polls /dashboard/state); a screenshot goes to the test output directory
($ATOMD_TEST_OUTPUT_DIR, else results/test-artifacts/, which git ignores). Chromium is
driven over its DevTools protocol with aiohttp's websocket client, so nothing beyond the
browser itself is needed. Without chromium the test installs it (as root, apt-get) or
fails saying how: it never skips.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import aiohttp
import pytest

from tests.fake_workers import Cluster, LoopThread

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

REPO = pathlib.Path(__file__).resolve().parents[1]


def output_dir() -> pathlib.Path:
    out = pathlib.Path(os.environ.get("ATOMD_TEST_OUTPUT_DIR") or REPO / "results" / "test-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


def chromium() -> str:
    """The chromium binary; installed with apt-get when missing and we are root, else a failure."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("the dashboard test needs headless Chromium: sudo apt-get install -y chromium")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.fail(f"could not install chromium ({' '.join(cmd)}): {r.stderr[-2000:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.fail("apt-get installed chromium but it is not on PATH")
    return found


class DevTools:
    """One page of a headless Chromium, over the DevTools protocol."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params):
        msg_id = next(self.ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expression: str):
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0):
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                text = await self.eval("document.body ? document.body.innerText : ''")
                raise AssertionError(f"the page never satisfied {expression!r}; it shows:\n{text}")
            await asyncio.sleep(0.1)


@pytest.fixture
def browser(tmp_path):
    binary = chromium()
    # its singleton socket's folder, removed after: short (a socket's path has ~108 bytes; tmp_path's is longer)
    sockets = tempfile.mkdtemp(prefix="atomd-chromium-", dir="/tmp")
    proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=sockets))
    try:
        port = None
        for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                port = int(m.group(1))
                break
        assert port is not None, f"chromium did not start (exit code {proc.poll()})"
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(sockets, ignore_errors=True)


def test_dashboard_shows_every_worker_and_updates_after_a_request(browser):
    loop = LoopThread()
    c = Cluster(loop, n_prefill=2, n_decode=2, health_interval_s=60, admin_api_key="admin-secret",
                prefill_policy="cache_aware")
    try:
        c.start()
        urls = sorted(f.url for f in c.prefill + c.decode)

        async def scenario() -> bytes:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{browser}/json/list") as r:
                    page = next(t for t in await r.json() if t["type"] == "page")
                async with s.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 << 20) as ws:
                    dt = DevTools(ws)
                    await dt.call("Page.enable")
                    await dt.call("Page.navigate", url=c.url + "/dashboard#key=admin-secret")
                    await dt.wait_for("document.querySelectorAll('#workers tbody tr').length === 4")
                    shown = json.loads(await dt.eval(
                        "JSON.stringify([...document.querySelectorAll('#workers tbody tr')]"
                        ".map(tr => [tr.dataset.workerUrl, tr.children[2].textContent, tr.children[3].textContent]))"))
                    assert sorted(u for u, _, _ in shown) == urls
                    assert all(h == "healthy" and b == "closed" for _, h, b in shown)
                    assert await dt.eval("document.getElementById('total-requests').textContent") == "0"
                    updates = await dt.eval("Number(document.body.dataset.updates)")
                    # a request through the router: the page (not reloaded) must show it
                    async with s.post(c.url + "/v1/completions", json={"model": "fake-model", "prompt": "a b c",
                                                                        "max_tokens": 4, "stream": True}) as r:
                        assert r.status == 200
                        await r.read()
                    await dt.wait_for("document.getElementById('total-requests').textContent === '1'")
                    assert await dt.eval("Number(document.body.dataset.updates)") > updates
                    await dt.wait_for("document.querySelector('#latency tbody').textContent.includes('completions')")
                    await dt.wait_for("document.querySelector('#decisions tbody').textContent.includes('cache_aware')")
                    # readable at 1024 px: no horizontal scroll, every column of every table inside
                    await dt.call("Emulation.setDeviceMetricsOverride", width=1024, height=768,
                                  deviceScaleFactor=1, mobile=False)
                    fit = json.loads(await dt.eval(
                        "JSON.stringify({scroll: document.documentElement.scrollWidth,"
                        " client: document.documentElement.clientWidth,"
                        " right: Math.max(...[...document.querySelectorAll('th, td')]"
                        ".map(c => c.getBoundingClientRect().right))})"))
                    assert fit["client"] > 1000 and fit["scroll"] <= fit["client"], fit
                    assert fit["right"] <= fit["client"], fit
                    shot = await dt.call("Page.captureScreenshot", format="png")
                    # without the key the data is refused, and the page says why
                    await dt.call("Page.navigate", url=c.url + "/dashboard")
                    await dt.wait_for("document.getElementById('status').textContent.includes('401')")
                    return base64.b64decode(shot["data"])

        png = loop.run(scenario(), timeout=120)
        assert png.startswith(b"\x89PNG")
        path = output_dir() / "router-dashboard.png"
        path.write_bytes(png)
        print(f"dashboard screenshot: {path}")
    finally:
        c.stop()
        loop.close()
