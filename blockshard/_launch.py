"""Run a function on W local gloo ranks (spawned processes): for tests, the demo and benchmarks.

``spawn_gloo(fn, W)`` starts W processes with the "spawn" start method, gives each an initialized gloo
process group (rendezvous through a ``FileStore`` in a fresh temporary directory, gloo bound to the
loopback interface, so concurrent runs cannot collide), calls ``fn(rank, W, *args)`` and returns the
per-rank results in rank order. ``run_single`` runs ``fn(0, 1, *args)`` in one spawned process without a
process group (a single-process reference with the same thread settings).

Failures never hang: a rank that raises makes the parent kill the others and raise ``RuntimeError``
with that rank's traceback; ranks still running after ``timeout`` seconds are killed and a
``TimeoutError`` names them. gloo's own timeout is set a bit under ``timeout`` (90 %), so a collective
that the other ranks never reach usually fails inside the rank first (a ``RuntimeError`` whose traceback
shows the collective) rather than being killed from outside.

Results and errors travel as plain pickles over one pipe per rank (tensors by value, no shared memory),
so a rank may exit right after returning. ``import blockshard`` does not import this module.

``BLOCKSHARD_SPAWN_METHOD=forkserver`` starts the ranks with the "forkserver" method instead: they
are forked from one server process that imported torch once (the first run starts it), so a run
starts in a fraction of a second instead of paying torch's import in every rank (the test suite
sets it: hundreds of runs). Each rank still gets the caller's environment variables, working
directory and ``sys.path`` as of that call, as under "spawn".
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from blockshard.planner._units import check_world_size

__all__ = ["run_single", "spawn_gloo"]

START_METHOD_ENV = "BLOCKSHARD_SPAWN_METHOD"  # "spawn" (default) or "forkserver"
_PRELOAD = ["torch", "torch.distributed"]  # what the forkserver imports once for every rank it forks
_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' errors (root cause)
_R = TypeVar("_R")  # what fn returns


def _check_finished() -> None:
    """blockshard's end-of-training check (``check_finished``), when the function used the engine."""
    import sys

    collectives = sys.modules.get("blockshard.runtime.core._collectives")
    if collectives is not None:
        collectives.check_finished()


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker(
    fn: Callable[..., object],
    rank: int,
    world_size: int,
    args: tuple[object, ...],
    store_path: str | None,
    gloo_timeout_s: float,
    threads: int,
    conn: Connection,
    env: dict[str, str],
) -> None:
    """Child entry point: set threads, join the group, run fn, send ("ok", value) or ("err", text)."""
    payload = None
    if os.environ != env:  # a forkserver's child starts with the server's variables: the caller's instead
        os.environ.clear()
        os.environ.update(env)
    try:
        torch.set_num_threads(threads)
        if store_path is None:
            result = fn(rank, world_size, *args)
        else:
            import torch.distributed as dist

            if "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := _loopback_ifname()):
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=gloo_timeout_s),
            )
            # Every rank has joined before any runs fn: a rank whose fn returns at once would
            # otherwise tear the group down under a peer still connecting its mesh (that peer's
            # init then fails with gloo's "Connection closed by peer", hiding the real outcome).
            dist.barrier()
            try:
                result = fn(rank, world_size, *args)
                _check_finished()
            except BaseException:
                # Report before tearing the group down, so this error (the root cause) reaches the
                # parent before the peers' "connection closed" errors that the teardown triggers.
                conn.send_bytes(pickle.dumps(("err", time.time(), traceback.format_exc())))
                conn.close()
                raise
            finally:
                dist.destroy_process_group()
        payload = pickle.dumps(("ok", time.time(), result))
    except BaseException:
        if not conn.closed:
            payload = pickle.dumps(("err", time.time(), traceback.format_exc()))
    try:
        if payload is not None:
            conn.send_bytes(payload)
    except (BrokenPipeError, OSError):
        pass  # the parent already gave up on this run
    finally:
        conn.close()


def _check(fn: object, world_size: int, args: tuple[object, ...], timeout: float, threads: int) -> None:
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable; pass a top-level function fn(rank, world_size, *args)")
    check_world_size(world_size)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an int >= 1 (torch threads per rank); pass e.g. threads=1")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0; pass e.g. timeout=300")
    if not isinstance(args, tuple):
        raise ValueError(f"args={args!r} must be a tuple; pass args=(x,) for one extra argument")
    for name, obj in (("fn", fn), ("args", args)):
        try:
            pickle.dumps(obj)
        except Exception as e:  # lambdas, local functions, open files...
            raise ValueError(
                f"{name}={obj!r} cannot be pickled for a spawned process ({e}); use a "
                "top-level function of an importable module and picklable arguments"
            ) from None


def _context() -> Any:
    """The multiprocessing context of :data:`START_METHOD_ENV` (see the module docstring)."""
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(
            f"{START_METHOD_ENV}={method!r} is not a start method spawn_gloo uses; set it to 'spawn' (the default) "
            "or 'forkserver', or unset it"
        )
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first run), ignored after
    return ctx


def _stop(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _run(
    fn: Callable[..., _R],
    world_size: int,
    args: tuple[object, ...],
    timeout: float,
    threads: int,
    group: bool,
    grace: float = _GRACE_S,
) -> list[_R]:
    _check(fn, world_size, args, timeout, threads)
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="blockshard-gloo-") if group else None
    store_path = os.path.join(tmp, "store") if tmp else None
    procs: list[BaseProcess] = []
    conns: dict[int, Connection] = {}
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                name=f"blockshard-rank{rank}",
                args=(fn, rank, world_size, args, store_path, 0.9 * timeout, threads, send, dict(os.environ)),
            )
            p.start()
            send.close()  # the child holds its own end; EOF here then means the child is gone
            procs.append(p)
            conns[rank] = recv
        results: dict[int, Any] = {}  # unpickled return values of fn
        errors: dict[int, tuple[float, str]] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            pending = [r for r in range(world_size) if r not in results and r not in errors]
            ready = wait([conns[r] for r in pending], timeout=deadline - now)
            for r in pending:
                if conns[r] not in ready:
                    continue
                try:
                    status, stamp, value = pickle.loads(conns[r].recv_bytes())
                except EOFError:
                    procs[r].join(5.0)
                    status, stamp, value = (
                        "err",
                        time.time(),
                        (
                            f"rank {r} exited with code {procs[r].exitcode} before returning a result "
                            "(a negative code is a signal; see its stderr: e.g. spawn re-imported a main "
                            "script that lacks `if __name__ == '__main__':`, out of memory, os._exit)"
                        ),
                    )
                except Exception as e:  # e.g. the result's class cannot be imported in the parent
                    status, stamp, value = (
                        "err",
                        time.time(),
                        (f"the result of rank {r} could not be unpickled in the parent: {e!r}"),
                    )
                if status == "ok":
                    results[r] = value
                else:
                    errors[r] = (stamp, value)
            if errors and deadline > time.monotonic() + grace:
                deadline = time.monotonic() + grace  # collect the peers' errors, then report
        if errors:
            order = sorted(errors, key=lambda r: errors[r][0])
            first = order[0]
            others = "".join(f"\n--- rank {r} also failed: {errors[r][1].strip().splitlines()[-1]}" for r in order[1:])
            missing = [r for r in range(world_size) if r not in results and r not in errors]
            unfinished = f"\n--- ranks {missing} had not finished and were killed" if missing else ""
            raise RuntimeError(
                f"rank {first} of {world_size} failed (first failing rank of "
                f"{order}):\n{errors[first][1]}{others}{unfinished}"
            )
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            raise TimeoutError(
                f"ranks {missing} of {world_size} did not finish within timeout={timeout} s; "
                "all ranks were killed. Raise timeout= if the work is legitimately slow, or "
                "look for a rank blocked in a collective that the other ranks never reach"
            )
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for c in conns.values():
            c.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def spawn_gloo(
    fn: Callable[..., _R],
    world_size: int,
    *,
    args: tuple[object, ...] = (),
    timeout: float = 300.0,
    threads: int = 1,
    grace: float = _GRACE_S,
) -> list[_R]:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes, each with an initialized
    gloo process group, and return the per-rank return values (picklable) in rank order.

    ``fn`` must be a picklable top-level function. Every rank calls ``torch.set_num_threads(threads)``
    first; the group's timeout is ``0.9 * timeout``. Raises ``RuntimeError`` (failing rank and its
    traceback) if a rank raises or dies, ``TimeoutError`` (unfinished ranks) after ``timeout`` seconds,
    ``ValueError`` for bad arguments. After a first failure the other ranks get ``grace`` seconds
    to finish or fail (their errors name the root cause) before they are killed.
    """
    return _run(fn, world_size, args, timeout, threads, group=True, grace=grace)


def run_single(fn: Callable[..., _R], *, args: tuple[object, ...] = (), threads: int = 1, timeout: float = 300.0) -> _R:
    """Run fn(0, 1, *args) in one spawned process without a process group and return its value.

    The single-process reference for sharding-invariance tests: same start method and thread setting
    as :func:`spawn_gloo`, same errors.
    """
    return _run(fn, 1, args, timeout, threads, group=False)[0]
