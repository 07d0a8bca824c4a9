"""Headless Chromium driven over the DevTools protocol on a pipe (tests only; stdlib only).

Chromium started with ``--remote-debugging-pipe`` reads protocol commands from fd 3 and writes
replies and events to fd 4, each message one JSON object ended by a NUL byte. That needs no
WebDriver, no websocket library and no network; the browser is told to resolve no host names,
so a page that tries to load anything from the network fails the test instead of waiting.

``find_chromium()`` names the binary (``$KVLENS_CHROMIUM``, then chromium / chromium-browser /
google-chrome on PATH); ``Browser`` opens one page and records console errors, exceptions and
every request the page makes.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SKIP_ENV = "KVLENS_SKIP_BROWSER_TESTS"


def find_chromium() -> str | None:
    env = os.environ.get("KVLENS_CHROMIUM")
    if env:  # named explicitly: that one or none
        return env if os.access(env, os.X_OK) else None
    return next((p for p in map(shutil.which, NAMES) if p), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, binary: str, width: int = 1200, height: int = 900, timeout: float = 30):
        self.timeout = timeout
        self.events: list[dict] = []
        self._next_id = 0
        self._buffer = b""
        self._profile = tempfile.TemporaryDirectory(prefix="kvlens-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._evt_r, evt_w = os.pipe()

        def wire_fds():  # in the child: the protocol's fds 3 (commands in) and 4 (replies out)
            a = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(evt_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
                "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost",
                f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
                "about:blank"]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      preexec_fn=wire_fds, close_fds=False)
        os.close(cmd_r)
        os.close(evt_w)
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget",
                                     {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                self.call(f"{domain}.enable", session=True)
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1,
                       "mobile": False}, session=True)
        except BaseException:
            self.close()
            raise

    # -- protocol ---------------------------------------------------------------------------
    def call(self, method: str, params: dict | None = None, session: bool = False) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError(f"no reply from Chromium within {self.timeout} s")
            chunk = os.read(self._evt_r, 1 << 16)
            if not chunk:
                err = self._proc.stderr.read().decode(errors="replace")[-2000:]
                raise BrowserError(f"Chromium closed the protocol pipe; stderr:\n{err}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def wait_event(self, method: str) -> dict:
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = self._read()
            self.events.append(e)
            if e.get("method") == method:
                return e

    # -- page -------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike) -> None:
        """Load a local file and wait for its load event (all images fetched)."""
        self.events.clear()
        url = Path(path).resolve().as_uri()
        result = self.call("Page.navigate", {"url": url}, session=True)
        if result.get("errorText"):
            raise BrowserError(f"navigation to {url} failed: {result['errorText']}")
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def prefer_dark(self, dark: bool) -> None:
        self.call("Emulation.setEmulatedMedia",
                  {"features": [{"name": "prefers-color-scheme",
                                 "value": "dark" if dark else "light"}]}, session=True)

    def screenshot(self, path: str | os.PathLike, full_page: bool = False) -> Path:
        import base64

        params: dict = {"format": "png"}
        if full_page:
            w, h = self.evaluate("[document.documentElement.scrollWidth, "
                                 "document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": w, "height": h, "scale": 1})
        data = self.call("Page.captureScreenshot", params, session=True)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions, error log entries and network requests."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                  for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                out.append(f"exception: {p.get('exceptionDetails', {}).get('text')}")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Network.requestWillBeSent":
                url = p.get("request", {}).get("url", "")
                if not url.startswith(("file:", "data:", "about:")):
                    out.append(f"network request: {url}")
        return out

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                os.write(self._cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode()
                         + b"\0")
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for fd in (self._cmd_w, self._evt_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._proc.stderr.close()
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
