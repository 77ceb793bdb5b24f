"""A command started now and waited for later: a one-process reference or another launch runs
beside a test's launch (a 2-process launch leaves a core idle while its launcher starts and its
ranks wait on each other). Output goes to a file, so no pipe fills while another job is waited for."""

from __future__ import annotations

import pathlib
import socket
import subprocess
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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once while they are picked)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
