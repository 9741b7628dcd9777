"""The two stores the publish tests run on: the local file system and a real S3 endpoint (moto's server).

A :class:`Store` hands out fresh output roots and reads them back through the same pyarrow layer the
job uses (:mod:`recsys.fs`), so a test reads exactly what a reader of that store would.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from recsys import fs as rfs
from recsys import storage
from recsys.processes import free_port

REPO = Path(__file__).resolve().parent.parent
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Store:
    name: str                          # "local" or "s3"
    base: str                          # a directory or s3://bucket/prefix of this test
    object_store: storage.ObjectStore = field(default_factory=storage.ObjectStore)

    def root(self, name: str = "recommendations") -> str:
        return rfs.join(self.base, name)

    def write(self, uri: str, data: bytes) -> None:
        fs, path = rfs.resolve(uri)
        if self.name == "local":
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)

    def snapshot(self, uri: str) -> dict[str, bytes]:
        """Every file under ``uri`` with its bytes."""
        fs, path = rfs.resolve(uri)
        if not rfs.is_dir(fs, path):
            return {}
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        out = {}
        for info in infos:
            if info.type == pafs.FileType.File:
                with fs.open_input_stream(info.path) as f:
                    out[info.path[len(path):].lstrip("/")] = f.read()
        return out

    def exists(self, uri: str) -> bool:
        fs, path = rfs.resolve(uri)
        return rfs.exists(fs, path)

    def child_env(self) -> dict[str, str]:
        """What a child process needs to reach this store (the job installs the same from storage.s3)."""
        return {**os.environ, "PYTHONPATH": str(REPO), **S3_CREDENTIALS,
                "STOREKIT_OBJECT_STORE": json.dumps(self.object_store.__dict__)}


def install_from_env() -> None:
    """In a child process: install the object store the parent's Store named."""
    raw = os.environ.get("STOREKIT_OBJECT_STORE")
    if raw:
        storage.install(storage.ObjectStore(**json.loads(raw)))


class MotoServer:
    """moto's S3-compatible HTTP server on 127.0.0.1 (a real server process speaking the S3 REST API), handling
    one request at a time so that its conditional writes are atomic, as S3's are (tests/moto_serial.py)."""

    def __init__(self, directory: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(directory / "moto.log", "ab")
        server = Path(__file__).with_name("moto_serial.py")
        self.proc = subprocess.Popen([sys.executable, str(server), "127.0.0.1", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's server exited with {self.proc.returncode}; see {directory / 'moto.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("moto's server did not listen within 60 s")
                time.sleep(0.1)
        self.object_store = storage.ObjectStore(endpoint=self.endpoint, path_style=True, region="us-east-1")

    def bucket(self) -> str:
        import boto3

        name = f"recsys-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials()).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


class S3Proxy:
    """A proxy on 127.0.0.1 in front of moto's server that passes requests through byte for byte, but for
    the conditional headers it drops and the methods it refuses. A context manager.

    ``drop_conditions_on``: the requests whose ``If-None-Match`` / ``If-Match`` headers are dropped: by
    default PUT and DELETE, an S3-compatible store that predates conditional writes (the dangerous kind:
    it answers every conditional write as a plain one); ``(b"DELETE",)``: a store with conditional writes
    but no conditional deletes. ``refuse``: methods answered 403 AccessDenied (``(b"PUT", b"POST",
    b"DELETE")``: read-only credentials). One request per connection (``Connection: close``), so that only
    request heads need parsing, whatever framing the body uses.
    """

    CONDITIONS = (b"if-none-match:", b"if-match:")
    HOP = (b"connection:", b"keep-alive:")
    DENIED = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>"
              b"<Message>Access Denied</Message></Error>")

    def __init__(self, server: MotoServer, drop_conditions_on: tuple[bytes, ...] = (b"PUT", b"DELETE"),
                 refuse: tuple[bytes, ...] = ()):
        self.drop_conditions_on = drop_conditions_on
        self.refuse = refuse
        self.target = ("127.0.0.1", server.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.object_store = storage.ObjectStore(endpoint=self.endpoint, path_style=True, region="us-east-1")
        self.dropped = 0      # conditional headers dropped
        self.refused = 0      # requests refused
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept() below (closing alone does not, on Linux)
        except OSError:
            pass
        self.listener.close()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
            head, rest = head.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            method = lines[0].split(b" ", 1)[0]
            if method in self.refuse:
                self.refused += 1
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: "
                               + str(len(self.DENIED)).encode() + b"\r\nConnection: close\r\n\r\n" + self.DENIED)
                return
            dropped = self.HOP + (self.CONDITIONS if method in self.drop_conditions_on else ())
            kept = [lines[0]] + [h for h in lines[1:] if not h.lower().startswith(dropped)]
            self.dropped += sum(1 for h in lines[1:] if h.lower().startswith(dropped[2:]))
            with socket.create_connection(self.target) as upstream:
                upstream.sendall(b"\r\n".join(kept + [b"Connection: close"]) + b"\r\n\r\n" + rest)
                back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
                back.start()
                _pipe(client, upstream)
                back.join(timeout=60)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def kill_at(argv: list[str], point: str, env: dict[str, str], timeout_s: float = 120) -> None:
    """Run a child process held at pause point ``point`` and SIGKILL it as soon as it says it is there."""
    env = {**env, "RECSYS_PAUSE_AT": point, "RECSYS_PAUSE_MAX_S": str(timeout_s)}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    reached = False
    tail: list[str] = []
    try:
        for line in proc.stderr:                       # blocks until the child writes, or EOF if it dies
            if line.startswith(f"recsys-pause: {point}"):
                os.kill(proc.pid, signal.SIGKILL)
                reached = True
                break
            tail = (tail + [line])[-20:]
    finally:
        if proc.poll() is None and not reached:
            proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    if not reached:
        raise AssertionError(f"the child never reached {point} (exit {proc.returncode}):\n{''.join(tail)}")
    assert proc.returncode == -signal.SIGKILL
