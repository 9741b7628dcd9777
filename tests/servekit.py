"""``recsys serve`` as a subprocess on loopback for the serve tests: start, poll, ask, read metrics, stop."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def until(condition, timeout: float, what: str, interval: float = 0.1):
    """Poll ``condition`` until it returns a truthy value or ``timeout`` passes (then fail, naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Frontend:
    """``recsys serve --conf CONF --port PORT [--set ...]``, run in ``root`` (its cwd), logging to a file there."""

    def __init__(self, root: Path, conf: Path, port: int, overrides: tuple[str, ...] = ()):
        self.root, self.conf, self.port = root, conf, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / f"serve-{port}.log"
        sets = [arg for item in overrides for arg in ("--set", item)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "recsys.cli", "serve", "--conf", str(conf), "--port", str(port), *sets],
            cwd=root, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env={**os.environ},
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the frontend exited ({self.proc.returncode}):\n{self.tail()}")
        try:
            return self.client.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def readyz(self) -> dict:
        return self.client.get("/readyz").json()

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def recommend(self, body) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return self.client.post("/v1/recommendations", content=content, headers={"content-type": "application/json"})

    def user(self, user_id: int, **params) -> httpx.Response:
        return self.client.get(f"/v1/users/{user_id}/recommendations", params=params)

    def metrics(self) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
