"""A command started now and waited for later: a one-process reference or another launch runs
beside a test's launch (a 2-process launch leaves a core idle while its launcher starts and its
ranks wait on each other). Output goes to a file, so no pipe fills while another job is waited for."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import time
from contextlib import ExitStack


class Background:
    def __init__(self, cmd: list[str], log: pathlib.Path, *, env: dict, cwd: pathlib.Path, timeout: float = 420):
        self.log, self.timeout = log, timeout
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)

    def wait(self) -> str:
        """Wait for the command; assert it succeeded; return its output."""
        self.proc.wait(timeout=self.timeout)
        out = self.log.read_text(errors="replace")
        assert self.proc.returncode == 0, out[-6000:]
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Jobs:
    """Commands run at most ``running`` at a time, started in the order added: a fixture's many
    launches (each 2 or more processes) would otherwise all compete for the machine's cores and
    memory at once, starving the other tests' spawned ranks. :meth:`wait` starts the job it waits for
    if it has not started, and starts the next ones as running ones finish."""

    def __init__(self, running: int) -> None:
        self.running = running
        self._queued: dict[str, tuple[list[str], pathlib.Path, dict, pathlib.Path, float]] = {}
        self._jobs: dict[str, Background] = {}

    def add(self, name: str, cmd: list[str], log: pathlib.Path, *, env: dict, cwd: pathlib.Path, timeout: float = 420):
        self._queued[name] = (cmd, log, env, cwd, timeout)
        self._top_up()

    def _start(self, name: str) -> None:
        cmd, log, env, cwd, timeout = self._queued.pop(name)
        self._jobs[name] = Background(cmd, log, env=env, cwd=cwd, timeout=timeout)

    def _top_up(self) -> None:
        busy = sum(job.proc.poll() is None for job in self._jobs.values())
        for name in list(self._queued)[: max(0, self.running - busy)]:
            self._start(name)

    def wait(self, name: str) -> str:
        """Wait for job ``name`` (started now if it was queued); assert it succeeded; return its output."""
        if name in self._queued:
            self._start(name)
        job = self._jobs[name]
        deadline = time.monotonic() + job.timeout
        while job.proc.poll() is None and time.monotonic() < deadline:
            self._top_up()
            time.sleep(0.2)
        out = job.wait()
        self._top_up()
        return out

    def kill(self) -> None:
        self._queued.clear()
        for job in self._jobs.values():
            job.kill()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once while they are picked)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
