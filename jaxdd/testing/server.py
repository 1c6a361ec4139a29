"""A ``python -m jaxdd.serve`` subprocess on loopback for the fault tests and the soak benchmark:
started on a free port, waited on until /health answers 200 (bounded) or not, stopped by its pid;
its metrics, and its resident memory, threads and open files from /proc (Linux). ``running_job``:
the same as a job of several processes (gloo), and ``complete`` a completion through the ``openai``
client."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

from jaxdd.testing.multiprocess import job_environment

# A bound for a hung start only (a server's or a CLI's): a process that exits is reported at
# once, and a cold start under a CPU hog on both cores outlasted the old, shorter bound.
START_SECONDS = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, process: subprocess.Popen, url: str, log: Path):
        self.process = process
        self.url = url
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def metric(self, name: str) -> float:
        return self.metrics(name)[name]

    def metrics(self, *names: str) -> dict[str, float]:
        """``jaxdd:`` metrics by name (labels included: ``cache_pages{state="free"}``), all from
        one scrape, so they belong to one moment."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for name in names:
            found = re.search(rf"^jaxdd:{re.escape(name)} (\S+)$", text, re.MULTILINE)
            if not found:
                raise KeyError(f"no metric jaxdd:{name}")
            values[name] = float(found.group(1))
        return values

    def usage(self) -> dict:
        """Resident memory (MB), threads and open file descriptors of the server process, now."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.MULTILINE).group(1)) / 1024
        threads = int(re.search(r"^Threads:\s+(\d+)", status, re.MULTILINE).group(1))
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        return {"rss_mb": rss, "threads": threads, "fds": fds}

    def wait_until(self, condition, seconds: float, poll: float = 0.05) -> bool:
        """``wait_until`` (the module's)."""
        return wait_until(condition, seconds, poll)

    def exit_code(self, seconds: float) -> int | None:
        """The exit status once the process ends within ``seconds``, else None (it still runs)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(seconds)
        return None


def wait_until(condition: Callable[[], object], seconds: float, poll: float = 0.05) -> bool:
    """Poll ``condition()`` until true or ``seconds`` pass; whether it became true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return bool(condition())


@contextlib.contextmanager
def started_server(args: list[str], log: Path, env: dict | None = None) -> Iterator[ServerProcess]:
    """Start ``python -m jaxdd.serve ARGS`` on a free loopback port, its stdout and stderr in
    ``log`` (not waited on); kill it by pid after."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxdd.serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield ServerProcess(process, f"http://127.0.0.1:{port}", log)
    finally:
        kill([process])


@contextlib.contextmanager
def running_server(args: list[str], log: Path, env: dict | None = None) -> Iterator[ServerProcess]:
    """``started_server``, once its /health answers 200."""
    with started_server(args, log, env) as server:
        wait_healthy(server, [server.process], [log])
        yield server


@contextlib.contextmanager
def running_job(
    args: list[str], folder: Path, processes: int = 2
) -> Iterator[tuple[ServerProcess, list]]:
    """``python -m jaxdd.serve ARGS`` as a job of ``processes`` processes
    on loopback (``--coordinator`` on a free port; process 0 serves HTTP on
    another), their logs in ``folder``: (process 0, the other processes),
    once /health answers; every process killed by its pid after."""
    port = free_port()
    coordinator = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxdd.serve",
        *args,
        "--coordinator",
        f"127.0.0.1:{coordinator}",
    ]
    command += ["--num-processes", str(processes)]
    logs = [folder / f"process{i}.log" for i in range(processes)]
    started = []
    try:
        for i, log in enumerate(logs):
            http = ["--host", "127.0.0.1", "--port", str(port)] if i == 0 else []
            with open(log, "w") as out:
                argv = [*command, "--process-id", str(i), *http]
                started.append(
                    subprocess.Popen(
                        argv, stdout=out, stderr=subprocess.STDOUT, env=job_environment()
                    )
                )
        server = ServerProcess(started[0], f"http://127.0.0.1:{port}", logs[0])
        wait_healthy(server, started, logs)
        yield server, started[1:]
    finally:
        kill(started)


def wait_healthy(
    server: ServerProcess, processes: list[subprocess.Popen], logs: list[Path]
) -> None:
    """Return once the server's /health answers 200; raise (with the
    logs) when a process exits first or ``START_SECONDS`` pass."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        for process, log in zip(processes, logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"{log.name}: exited ({process.returncode}):\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    texts = "\n".join(f"{log.name}:\n{log.read_text()}" for log in logs)
    raise RuntimeError(f"the server was not healthy within {START_SECONDS} s:\n{texts}")


def kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)


def complete(client: openai.OpenAI, request: dict) -> tuple[list[int], str, str, dict | None]:
    """(token ids, text, finish reason, usage) of a
    completion, streamed (``"stream": True``) or not."""
    options = {k: v for k, v in request.items() if k != "stream"}
    extra = {"return_token_ids": True}
    if not request.get("stream"):
        response = client.completions.create(model="kimi-mini", extra_body=extra, **options)
        choice = response.choices[0]
        return (
            choice.token_ids,
            choice.text,
            choice.finish_reason,
            response.usage.model_dump(exclude_none=True),
        )
    ids = []
    text = ""
    finish = None
    usage = None
    stream = client.completions.create(
        model="kimi-mini",
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **options,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for choice in chunk.choices:
            ids += choice.token_ids
            text += choice.text
            finish = choice.finish_reason or finish
    return ids, text, finish, usage
