"""A ``python -m jaxdd.serve`` subprocess on loopback for the fault tests and the soak benchmark: started on a free
port, waited on until /health answers 200 (bounded), stopped by its pid; its metrics, and its resident memory,
threads and open files from /proc (Linux)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

START_SECONDS = 300  # loading and compiling the demo pair on a busy 2-core host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        self.process, self.url, self.log = process, url, log

    @property
    def pid(self) -> int:
        return self.process.pid

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(rf"^jaxdd:{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if not found:
            raise KeyError(f"no metric jaxdd:{name}")
        return float(found.group(1))

    def usage(self) -> dict:
        """Resident memory (MB), threads and open file descriptors of the server process, now."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.MULTILINE).group(1)) / 1024
        threads = int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE).group(1))
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        return {"rss_mb": rss, "threads": threads, "fds": fds}

    def wait_until(self, condition, seconds: float, poll: float = 0.05) -> bool:
        """Poll ``condition()`` until true or ``seconds`` pass; whether it became true."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(poll)
        return bool(condition())

    def exit_code(self, seconds: float) -> int | None:
        """The exit status once the process ends within ``seconds``, else None (it still runs)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(seconds)
        return None


@contextlib.contextmanager
def running_server(args: list[str], log: Path, env: dict | None = None) -> Iterator[ServerProcess]:
    """Start ``python -m jaxdd.serve ARGS`` on a free loopback port and wait for /health; kill it by pid after."""
    port = free_port()
    command = [sys.executable, "-m", "jaxdd.serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the server was not healthy within {START_SECONDS} s:\n{log.read_text()}")
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
