"""In-process gloo ranks for the fast engine tests: W = 1 in the test process, W >= 2 on threads.

What works (torch 2.13 CPU, measured here):

* **W = 1** (fixture ``gloo_w1`` in conftest.py): a real gloo default group initialised in the
  test process over a ``FileStore`` in a fresh temporary directory (about 2 ms to init and
  destroy), one per test module, destroyed at the module's end so slow tests that need *no*
  process group still see none. Every collective is a real gloo call (W = 1 all-gathers and
  reduce-scatters are copies inside gloo).
* **W >= 2 on threads** (:func:`run_ranks`, ``spawn_gloo``'s signature plus ``kwargs``): every rank is
  a thread with its *own default* gloo group — a real ``ProcessGroupGloo`` over one shared
  ``HashStore``, real TCP pairs on the loopback interface — so the engine runs unmodified
  (``mesh=None``, ``dist.is_initialized()``, ``dist.all_gather_object``) and the scenario
  functions of ``_scenarios.py`` / ``_misuse.py`` run in threads exactly as in spawned ranks.
  This needs c10d's world (the default group and its maps) to be per thread: while ranks run,
  ``torch.distributed.distributed_c10d._world`` is torch's own ``ThreadLocalWorld`` (from
  ``torch.testing._internal.distributed.multi_threaded_pg``, what ``FSDPTestMultiThread``
  installs), restored afterwards. Unlike ``FSDPTestMultiThread`` we keep gloo (not torch's
  Python "threaded" backend), so reduce-scatter AVG is gloo's own sum-then-divide.
  c10d's C++ group registry (names -> groups) is process-global too: every rank's default
  group is named "0", so the harness turns on its thread isolation mode
  (``torch._C._distributed_c10d._set_thread_isolation_mode``, as ``MultiThreadedTestCase``
  does) while ranks run (without it the second rank fails: "A process group is already
  registered under the name 0"); each rank then ends with a plain ``dist.destroy_process_group()``.
  Ranks of one run rendezvous through a fresh ``HashStore``, so runs never collide.

Failures never hang and always reach the test:

* an exception in a rank is re-raised in the test (the first failing rank's own exception, with
  a note naming the rank and the other ranks' errors); ``pytest.raises`` and ``xfail`` see its
  real type;
* a failing rank frees its gloo group at once, which closes its TCP pairs, so a peer blocked
  in a collective fails within milliseconds ("Connection closed by peer") instead of waiting
  for gloo's timeout (``gloo_timeout_s``, the backstop). gloo has no abort (``pg.abort()``, the
  backend's ``abort()`` and ``destroy_process_group()``'s ``shutdown()`` leave the pairs open,
  measured): only freeing the group's last reference
  closes them, so the failing rank drops its frames' locals and collects garbage (the engine's
  state lives on the sharded module, so a dropped model and its group are freed; see
  ``test_a_dropped_sharded_model_is_freed``). Every rank frees its group when it ends, so no
  gloo context is left to be destroyed at interpreter exit (that aborted the process with
  "terminate called without an active exception" now and then);
* ranks still running after ``timeout`` seconds raise ``TimeoutError`` naming them. Threads
  cannot be killed: a rank stuck outside any collective (a Python loop) is left behind as a
  daemon thread (a rank stuck *in* one fails by the gloo timeout); every test module also
  carries ``pytest.mark.timeout(60)``, for code that hangs in the test thread itself.

What threads do not allow:

* bitwise parity with one process needs identical arithmetic on every rank, so the harness runs
  torch with one intra-op thread, as the spawned tests do. ``torch.set_num_threads`` must be
  called *in each rank thread*: OpenMP's thread count is per calling thread, and a new thread
  starts with the machine's default (measured: OddMLP at batch 6 then differs from one
  process by 9e-8 after 2 steps, while spawned ranks are bitwise equal);
* ranks share one interpreter, so a test cannot show that something is *per process* (that is
  what the spawned slow tier is for); the engine keeps its state on the sharded modules, so
  ranks do not collide. Ranks should return what they found and let the test thread assert on it;
* torch's default generator is process-wide: two ranks building ``OddMLP()`` at once (its
  constructor seeds it inside ``fork_rng``) get different weights (measured: the first loss
  differs by 4e-3). Build models under :func:`serial`;
* lazy imports are not thread-safe: two ranks importing ``transformers``' lazy modules at
  once fail ("cannot import name 'LlamaConfig'", measured); :func:`serial` covers that too;
* the GIL serialises the Python parts of the ranks, so threads test order, states and values,
  never speed; process-global settings (``torch.set_num_threads``, environment variables) are shared.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
from torch.utils._python_dispatch import TorchDispatchMode

from blockshard.runtime.core._collectives import issuing_header, watch_skipped

__all__ = [
    "CollectiveLog",
    "hidden_process_group",
    "init_world1",
    "run_ranks",
    "serial",
    "single_thread",
]

_RUN_LOCK = threading.Lock()  # one threaded run at a time (the world swap is process-wide)
_SERIAL = threading.RLock()


def serial():
    """A process-wide lock for rank code that uses process-global state: building a model whose
    constructor seeds torch's default generator (``blockshard._tiny`` does, inside
    ``fork_rng``), or a first lazy import. ``with _inproc.serial(): model = OddMLP()``. Never
    hold it across a collective (``fully_shard`` issues one): the peers would wait on the lock."""
    return _SERIAL


def _use_loopback() -> None:
    names = [name for _, name in socket.if_nameindex()]
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    if lo and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread while inside (bitwise comparisons need the same arithmetic)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def init_world1() -> tempfile.TemporaryDirectory:
    """Initialise a real gloo default group of one rank in this thread; returns its store dir."""
    _use_loopback()
    tmp = tempfile.TemporaryDirectory(prefix="blockshard-w1-")
    store = dist.FileStore(os.path.join(tmp.name, "store"), 1)
    hook = sys.excepthook
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    sys.excepthook = hook  # not the "[rank0]:" prefixing hook init_process_group installs
    return tmp


@contextmanager
def world1() -> Iterator[dist.ProcessGroup]:
    """A real gloo default group of one rank in this thread, with one intra-op thread, destroyed on
    leaving (the conftests' ``gloo_w1`` fixtures)."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized: a test leaked one")
    with single_thread():
        tmp = init_world1()
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
            tmp.cleanup()


@contextmanager
def _thread_local_world() -> Iterator[None]:
    """c10d's world (default group, group maps) per thread while inside; restored afterwards."""
    with _RUN_LOCK:
        old = c10d._world
        c10d._world = ThreadLocalWorld()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        try:
            yield
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            c10d._world = old


@contextmanager
def hidden_process_group() -> Iterator[None]:
    """This thread sees no default process group while inside (for "no process group" errors)."""
    with _thread_local_world():
        yield


def _join_world(store: dist.Store, rank: int, world_size: int, gloo_timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=gloo_timeout_s)
    )


def _leave_world() -> None:
    """Destroy and free this thread's default group: gloo has no abort, and freeing closes the TCP
    pairs, so blocked peers fail at once (after a failure the frames' locals were dropped first);
    a garbage collection breaks the module <-> state cycles."""
    if not isinstance(c10d._world, ThreadLocalWorld):
        return  # a straggler after its run timed out: the test thread restored c10d's world
    dist.destroy_process_group()
    gc.collect()


def _drop_locals(exc: BaseException) -> None:
    """Clear the local variables of the finished frames of ``exc`` and of its chained exceptions
    (the traceback text stays), so the models they held, and their process group, can be freed."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def run_ranks(
    fn: Callable,
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 60.0,
    gloo_timeout_s: float = 10.0,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` threads, each with its own initialised
    gloo default group, and return the results in rank order (one intra-op torch thread).

    ``fn`` may be any callable (closures too). Raises the first failing rank's exception (with a
    note naming the rank and the others' errors), or ``TimeoutError`` after ``timeout`` seconds.
    """
    _use_loopback()
    store = dist.HashStore()
    results: dict[int, object] = {}
    errors: dict[int, tuple[float, BaseException]] = {}

    def rank_main(rank: int) -> None:
        joined = False
        try:
            torch.set_num_threads(1)  # OpenMP's thread count is per calling thread: set it here too
            _join_world(store, rank, world_size, gloo_timeout_s)
            joined = True
            results[rank] = fn(rank, world_size, *args, **(kwargs or {}))
        except BaseException as exc:
            _drop_locals(exc)
            errors[rank] = (time.monotonic(), exc)
        finally:
            if joined:
                _leave_world()

    hook = sys.excepthook  # init_process_group wraps it (a "[rankN]:" prefix) on every call
    with single_thread(), _thread_local_world():
        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"blockshard-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    sys.excepthook = hook
    if errors:
        order = sorted(errors, key=lambda r: errors[r][0])
        first = errors[order[0]][1]
        first.add_note(f"[run_ranks] raised on rank {order[0]} of {world_size} (first failing rank of {order})")
        for r in order[1:]:
            first.add_note(f"[run_ranks] rank {r} also failed: {type(errors[r][1]).__name__}: {errors[r][1]}")
        raise first
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not finish within timeout={timeout} s (threads cannot be "
            "killed; they were left as daemons). Look for a rank blocked in a collective the others never reach"
        )
    return [results[r] for r in range(world_size)]


# -- collective log ---------------------------------------------------------------------------
_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather_list",  # list form: what dist.all_gather_object uses
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter_list",
    "allreduce_": "all_reduce",
    "alltoall_base_": "all_to_all",
}


class CollectiveLog(TorchDispatchMode):
    """Records every c10d collective issued in this thread while active, in issue order.

    c10d's Python API (``all_gather_single``, ``reduce_scatter_single``, ...) dispatches
    ``torch.ops.c10d.*`` ops, so this catches the engine's collectives whatever Python function
    or module issued them (``_buffers.py`` imports its helpers by name, which a module-attribute
    spy would miss). Dispatch modes are per thread, so each rank of :func:`run_ranks` logs only
    its own. A collective is labelled with the group whose persistent buffer it reads or writes
    (``blockshard.runtime.local_buffers``: an all-gather sends from ``local``, a reduce-scatter lands in
    the gradient buffer, which it allocates; see [Note: buffers]); :meth:`label_groups` registers a
    sharded model, whose buffers are looked up again when a collective's tensor is not known yet.
    ``events`` is a list of ``(kind, label)`` and of ``("mark", text)`` added with :meth:`mark`;
    blockshard's headers are logged as kind ``"header"``. On a group of one rank the engine issues
    no collective ([Note: one rank] in _collectives.py); the log records the ones it skipped as if
    issued, so the engine's schedule reads the same at W = 1.
    The first use of a dispatch mode in a process imports ``torch._dynamo`` (about 1-2 s).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str | None]] = []
        self.groups: dict[int, str] = {}
        self.models: list[torch.nn.Module] = []

    def label_groups(self, model: torch.nn.Module) -> None:
        self.models.append(model)
        self._refresh()

    def _refresh(self) -> None:
        from blockshard.runtime import local_buffers

        self.groups = {}  # rebuilt: a freed gradient buffer's address may be reused
        for model in self.models:
            for name, buffers in local_buffers(model).items():
                for buf in buffers.values():
                    self.groups[buf.untyped_storage().data_ptr()] = name

    def mark(self, what: str) -> None:
        self.events.append(("mark", what))

    def __enter__(self):
        self._watch = watch_skipped(self._record)
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._watch.__exit__(*exc)

    def _record(self, kind: str, tensors: tuple) -> None:
        label = None
        self._refresh()  # gradient buffers come and go with the step
        for t in tensors[:2]:
            if isinstance(t, torch.Tensor) and label is None:
                label = self.groups.get(t.untyped_storage().data_ptr())
        self.events.append((kind, label))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            kind = "header" if issuing_header() else _KINDS.get(func._opname, func._opname)
            self._record(kind, args)
        return func(*args, **(kwargs or {}))

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.events)
