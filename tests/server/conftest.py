"""Real `plait serve` processes on 127.0.0.1 for the server tests, and helpers to talk to them.

Servers are started as subprocesses exactly as a user starts them (``python -m plait serve``) on a
tiny checkpoint. The main server is shared by the whole session; tests that kill or stop a server
get their own.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from plait.server.bench import read_metrics

pytest.importorskip("openai")
pytest.importorskip("fastapi")

# Every request in these tests is small; a stuck server must fail a test, not hang the suite.
HTTP_TIMEOUT = 60.0
STARTUP_TIMEOUT = 120.0
# Prompt token id that makes the scheduler process raise for that request (plait.envs
# FAULT_INJECT_TOKEN): a padding id of the tiny vocabulary, which tokenized text never contains.
FAULT_TOKEN = 511
# Engine settings shared by the main server and the offline Engine it is compared with.
MAIN_ENGINE_FLAGS = {"max_total_tokens": 16384, "context_length": 2048, "max_running_requests": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


class Server:
    """One `plait serve` subprocess."""

    def __init__(self, model: pathlib.Path, log_dir: pathlib.Path, name: str, env: dict[str, str] | None = None,
                 **flags: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        cmd = [sys.executable, "-m", "plait", "serve", "--model", self.model, "--port", str(self.port),
               "--device", "cpu"]
        # One HTTP process unless a test asks for more: the default follows the machine's CPU count, and a
        # test (scheduler_pid, /metrics right after a request) must not change with the machine it runs on.
        flags = {"tokenizer_worker_num": 1, **flags}
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif isinstance(value, list | tuple):
                cmd += [flag, *map(str, value)]
            elif value is not None and value is not False:
                cmd += [flag, str(value)]
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._terminated = False

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def scheduler_pid(self) -> int:
        children = child_pids(self.proc.pid)
        assert len(children) == 1, f"expected one scheduler process, found {children}"
        return children[0]

    def terminate(self) -> None:
        """SIGTERM, once: the server drains and exits (seconds); ``stop`` waits for it."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    # --- convenience ---
    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT,
                             **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=HTTP_TIMEOUT, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=HTTP_TIMEOUT, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as name -> value."""
        return read_metrics(self.url)

    def wait_idle(self, timeout: float = 2.0) -> dict[str, float]:
        """/metrics once nothing runs, waits or holds KV (the scheduler's last snapshot lands a moment
        after the last response); returns the last reading either way."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["plait:num_requests_running"] == 0 and m["plait:num_requests_waiting"] == 0
                    and m["plait:kv_slots_in_use"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


@pytest.fixture(scope="session")
def server_model(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def start_server(server_model, tmp_path_factory) -> Iterator[Any]:
    """Factory: start a server with extra flags; every server started is stopped at session end."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(name: str, env: dict[str, str] | None = None, wait: bool = True, **flags: Any) -> Server:
        srv = Server(server_model, log_dir, f"{name}-{len(started)}", env=env, **flags)
        started.append(srv)
        return srv.wait_ready() if wait else srv

    yield start
    # Signal every server first: they drain in parallel, and the session ends after the slowest
    # shutdown rather than after the sum of them.
    for srv in started:
        srv.terminate()
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def server(start_server) -> Server:
    """The shared server: most tests talk to it."""
    return start_server("main", env={"PLAIT_FAULT_INJECT_TOKEN": str(FAULT_TOKEN)},
                        max_payload_bytes=1_000_000, **MAIN_ENGINE_FLAGS)


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return server.model


@pytest.fixture(scope="session")
def client(server):
    return server.openai()


@pytest.fixture(scope="session")
def offline_engine(server_model):
    import plait

    engine = plait.Engine(model=str(server_model), device="cpu", **MAIN_ENGINE_FLAGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tokenizer(server_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_model)
