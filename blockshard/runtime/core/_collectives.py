"""The collectives the engine issues, in one place.

Phase by phase (one group, bucket ``b`` with segment ``S_b``; ``W`` ranks):
  * **all-gather** (unshard): every rank sends its ``S_b`` local elements (cast to the parameter
    dtype) and receives ``W * S_b`` into the bucket's slice of the gathered buffer, whose views
    *are* the unsharded parameters: no copy-out.
  * **reduce-scatter** (gradient sync): every rank sends the bucket's ``W * S_b`` slice of the
    gathered gradient buffer and receives the average of its own ``S_b`` segment over ranks.
  * **layout check** (once per ``fully_shard``): an all-gather of a small object so a rank whose
    layout differs raises before any tensor collective could hang on mismatched sizes.
  * **end-of-step check** (once per backward, in the final callback): see below.

[Note: gloo's copies]
Measured on torch 2.13 (``ProcessGroupGloo.cpp``, and the allocator's events in
docs/engine_benchmark.md): gloo on the CPU runs a collective on buffers of its own, so an
asynchronous collective holds a second copy of its largest operand while in flight.
  * **reduce-scatter**: ``c10d::_reduce_scatter_base_`` clones the ``W * S`` input, all-reduces
    the clone on a gloo thread and copies this rank's segment into the output inside
    ``Work.wait()`` (so ``is_completed()`` stays False until then). The engine's input is never
    read after the call returns: it is freed right away, and the clone (owned by the work) is
    what stays alive until the wait ([Note: async reduce-scatter] in _grad_sync.py).
  * **all-gather**: a gloo thread gathers into a flat ``W * S`` temporary and then copies it into
    the output, so a prefetch in flight holds the gathered buffer twice. Where this happens in
    the backward (a prefetch issued at a group's pre-backward runs during its backward compute,
    beside the reduce-scatter in flight), it is waited for at once, as FSDP2 does on the CPU
    (``unshard_async_op=False``): :func:`holds_copies` is the switch.
On NCCL neither copy exists (collectives run in place on their own stream).

[Note: one rank]
Over a group of one rank (W = 1, or an HSDP replicate dimension of 1) the engine issues no
collective, as FSDP2 issues none (its test_train_parity_single_worldsize1 asserts it): the
all-gather and the reduce-scatter are copies (the average over one rank is the rank's own value,
bitwise), and the all-reduces (HSDP's, the gradient norm's, the end-of-step check's) have nothing
to combine. Headers are off there too. The bookkeeping (step counts, traffic, the optimizer
checks) runs as at W > 1. Measured with torch's ``CommDebugMode`` in test_fast_one_rank.py. A tool that
follows the engine's schedule through c10d's ops (the tests' collective log) sees the collectives
not issued through :func:`watch_skipped`.

[Note: collective integrity]
Collectives that do not line up across ranks (a rank skips a step, runs an extra forward, leaves
a module unused, or has other requires_grad flags) either hang or pair the wrong buffers. Three
guards make every such case an error on every rank, in bounded time, at next to no cost:
  1. **Bounded waits.** Every engine collective waits at most ``BLOCKSHARD_COLLECTIVE_TIMEOUT_S``
     seconds (default 30, at least 1, at most a day; gloo's own default is 30 minutes). ``Work.wait(timeout)`` alone does
     not bound gloo: only the process group's own timeout applies (measured on torch 2.13: an
     async reduce-scatter whose peer issued 4 s late was waited for 4 s under ``wait(timeout=1 s)``;
     the issuing call itself returns at once). So on gloo the engine issues its collectives
     on a process group of its own over the same ranks, created once per user group with that
     timeout (:func:`engine_group`; ``new_group(..., use_local_synchronization=True)``, about 1 ms).
     On other backends (NCCL) the user's group is used as it is and its timeout applies (set it
     with ``init_process_group(timeout=...)``; NCCL's watchdog aborts a stuck collective).
  2. **Failures are reported.** A timeout or a failed peer raises :class:`CollectiveIntegrityError`
     naming the group, the phase and the ranks involved: the failing rank writes one key to the
     group's store (``blockshard/failed/<rank>``) and reads the others' for at most
     ``_REPORT_WAIT_S``, so the message says which peers failed (and how) and which never
     reported (exited, were killed, or are stuck outside blockshard).
  3. **The end-of-step check.** Each rank's root context counts the collectives it issues in a
     step (a count and an order-sensitive hash of (group, kind); a group's all-gather or
     reduce-scatter counts once whatever its number of buckets, its quantized weights' all-gather
     once more), hashes the requires_grad flags
     and counts the backwards after which an optimizer had stepped its parameters (ranks that
     never step one, holding nothing to step, are left out); at the end of backward one
     all-reduce (MAX of the five int64 and of their negatives: every field's max and min)
     compares them and the step number, so collectives that paired silently raise before
     ``optimizer.step()`` can use the gradients (only then an all-gather collects the details).
The cost is one 80-byte all-reduce per step, whatever the number of groups (measured in
docs/engine_benchmark.md), and nothing per collective beyond the count.

  4. **Headers** ([Note: collective headers] below) keep gloo from pairing buffers of other sizes,
     which aborts the process instead of raising.
  5. **The end of training.** A rank that skips a whole step (forward, backward and optimizer
     step) issues exactly the collectives of a rank that ran one step fewer, so the two pair up;
     the ranks diverge only where one runs a step the other never reaches: that rank raises
     within the bound, naming the peer that never reported, while the one that skipped finishes
     its loop. :func:`check_finished` (called by ``spawn_gloo`` after the function returns; call
     it after the training loop under torchrun) makes that rank raise too: every rank writes the
     number of end-of-step checks it ran to the store and waits, at most the collective timeout
     plus 2 s, for its peers' counts or failure reports; a peer that failed, ran another number of
     steps or never finishes raises :class:`CollectiveIntegrityError` (a rank that failed itself
     has raised already and checks nothing).

[Note: collective headers]
Where two ranks issue collectives of other sizes on one gloo group (one rank runs an extra forward,
skips a backward, turns gradient sync off, or calls ``load_checkpoint`` alone), gloo pairs the
mismatched buffers and ``abort()``s the receiving process ("Received data size doesn't match
expected size"): no Python error, no message. So before every collective the engine issues on a gloo
group during training (each buffer set's all-gather, each reduce-scatter and all-reduce, the
end-of-step check, the gradient-norm all-reduce, the collectives of state dicts, checkpoints and
owner-compute) and at the start of every public call that issues collectives (``load_checkpoint``,
``save_checkpoint``, ``full_state_dict``, ...), every rank contributes a *header* to one all-gather
of ``_HEADER_FIELDS`` int64 on a third group over the same ranks (:func:`agree`): a CRC-32 of what
it is about to issue (the collective and its group, e.g. "the all-gather of group 'Linear'
(layers.0)"), the phase (forward, backward, end of step, between steps), its element count and
dtype, and its group's gradient sync (on, off, or none for buffer sets that do not train). Headers have one size on every rank, so they always pair; the data collective is issued only
after every rank's header matched, so the ``n``-th data collectives always agree in size. Where the
headers differ, every rank has seen the same rows: the ranks exchange what each was about to issue
(one ``all_gather_object`` on the header group) and every rank raises
:class:`CollectiveIntegrityError` naming each rank's collective and the likely cause (an extra
forward or a skipped backward, gradient sync on some ranks only, a call on some ranks only).
Nothing of the data was exchanged. A rank that issues a collective without a header (a peer that
calls torch directly) leaves its peers waiting on the header group: bounded by the timeout as any
other wait (point 1).

The headers' group is separate from the engine's so a header never pairs with a data collective:
a rank that skipped a header blocks its peers in the header's all-gather instead of feeding gloo a
buffer of another size. It is created with the engine's group (:func:`engine_group`), on gloo with
W > 1 only. Cost: one blocking all-gather of 40 bytes per engine collective (a prefetch's header is
sent when the prefetch is issued); measured in docs/engine_benchmark.md ("Collective headers").
``BLOCKSHARD_COLLECTIVE_HEADERS=0`` (read once per group, when ``fully_shard`` creates it; every
rank must agree, and ``fully_shard`` checks it) turns them off: mismatched collectives then abort
the process again, and the end-of-step check still catches those that paired silently. On NCCL
there are no headers (a header would wait for the GPU at every collective): mismatched
collectives there hang until NCCL's own timeout (``init_process_group(timeout=...)``), and the
end-of-step check catches those that paired.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch
import torch.distributed as dist

from blockshard._errors import BlockshardError, CollectiveIntegrityError, LayoutMismatchError
from blockshard.runtime.core._common import phase_kind

__all__ = [
    "DONE",
    "HEADERS_ENV",
    "TIMEOUT_ENV",
    "CollectiveIntegrityError",
    "LayoutMismatchError",
    "agree",
    "agree_call",
    "all_gather_into",
    "all_reduce_in_place",
    "check_finished",
    "check_same_layout",
    "collective_timeout_s",
    "engine_group",
    "headers_on",
    "holds_copies",
    "note_step",
    "reduce_scatter_avg",
    "shift_ranks",
    "step_mismatch",
    "uses_headers",
    "wait",
    "watch_skipped",
]

#: Seconds an engine collective may wait for its peers before every waiting rank raises.
TIMEOUT_ENV = "BLOCKSHARD_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
_MIN_TIMEOUT_S = 1.0  # below it gloo's connection setup fails (1e-3: 'Connect timeout'), as does a loaded rank
_MAX_TIMEOUT_S = 86400.0
_REPORT_WAIT_S = 1.0  # after a failure, how long to wait for the peers' reports (point 2 of the Note)
_REPORT_PREFIX = "blockshard/failed/"

# user process group -> the engine's group over the same ranks (point 1 of the Note); weak keys,
# so a destroyed and dropped user group frees the engine's. The user group lives in c10d's maps
# until it is destroyed, so every rank finds the same entry at the same fully_shard call.
_ENGINE_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()
# point 4: end-of-step checks run per engine group on this rank, the groups this rank reported a
# failure on, and how often check_finished ran per group (its store keys' generation)
_STEPS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_FAILED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
_FINISHED: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_DONE_PREFIX = "blockshard/done/"

#: Set to 0 to turn off the headers of [Note: collective headers] (on by default on gloo).
HEADERS_ENV = "BLOCKSHARD_COLLECTIVE_HEADERS"
_HEADER_FIELDS = 5  # CRC-32 of what, CRC-32 of the phase, numel, CRC-32 of the dtype, sync (1, 0; -1: none)


@dataclass(eq=False)
class _Headers:
    """[Note: collective headers] The header group of one engine group (and of its user group)."""

    group: dist.ProcessGroup  # where the headers are all-gathered
    engine_ref: weakref.ref[dist.ProcessGroup]  # the engine group they guard (its store takes the reports)
    on: bool  # BLOCKSHARD_COLLECTIVE_HEADERS when the group was made

    @property
    def engine(self) -> dist.ProcessGroup:
        found = self.engine_ref()
        return self.group if found is None else found  # (an entry outlives its engine group only while it dies)


# user group and engine group -> their headers, and header group -> its engine group. Weak keys, as
# _ENGINE_GROUPS, and nothing in a value refers to its key strongly: a value that did would keep its
# key, and the gloo group's TCP pairs, alive for the process (a failed thread rank's peers then
# waited out the timeout instead of seeing the connection close).
_HEADERS: weakref.WeakKeyDictionary[dist.ProcessGroup, _Headers] = weakref.WeakKeyDictionary()
_HEADER_ENGINE: weakref.WeakKeyDictionary[dist.ProcessGroup, weakref.ref[dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather: Callable[..., dist.Work | None] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter: Callable[..., dist.Work | None] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def collective_timeout_s() -> float:
    """[Note: collective integrity] The bound on one engine collective's wait, in seconds."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not _MIN_TIMEOUT_S <= value <= _MAX_TIMEOUT_S:
        raise BlockshardError(
            f"environment variable {TIMEOUT_ENV}={raw!r} must be a number of seconds >= {_MIN_TIMEOUT_S:g} and "
            f"<= {_MAX_TIMEOUT_S:g} (a day; below a second gloo's connection setup times out), e.g. 30"
        )
    return value


def headers_on() -> bool:
    """[Note: collective headers] Whether new engine groups send headers (``BLOCKSHARD_COLLECTIVE_HEADERS``)."""
    raw = os.environ.get(HEADERS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise BlockshardError(
            f"environment variable {HEADERS_ENV}={raw!r} must be 1 (check every collective's size before it is "
            "issued, the default) or 0 (no check: mismatched collectives abort the process), e.g. unset it"
        )
    return raw != "0"


def engine_group(process_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group the engine issues its collectives on for ``process_group`` (point 1 of
    [Note: collective integrity]): on gloo with W > 1 a group of its own over the same ranks,
    whose timeout is :func:`collective_timeout_s`; otherwise ``process_group`` itself. With it, the
    group of its headers ([Note: collective headers])."""
    if process_group.size() == 1 or dist.get_backend(process_group) != "gloo":
        return process_group
    found = _ENGINE_GROUPS.get(process_group)
    if found is None:
        on = headers_on()
        ranks, timeout = dist.get_process_group_ranks(process_group), collective_timeout_s()
        found, header = (
            dist.new_group(
                ranks, timeout=datetime.timedelta(seconds=timeout), backend="gloo", use_local_synchronization=True
            )
            for _ in range(2)  # made on every rank in this order, whether headers are on or not
        )
        _ENGINE_GROUPS[process_group] = found
        _HEADERS[process_group] = _HEADERS[found] = _Headers(header, weakref.ref(found), on)
        _HEADER_ENGINE[header] = weakref.ref(found)
    return found


# Per thread (thread ranks issue headers at once): set while agree() issues a header all-gather.
_issuing = threading.local()


@contextlib.contextmanager
def _as_header() -> Iterator[None]:
    _issuing.header = True
    try:
        yield
    finally:
        _issuing.header = False


def issuing_header() -> bool:
    """Whether the collective this thread is issuing now is a header of [Note: collective headers]:
    for tools that count the engine's collectives (the benchmarks, the tests' collective log),
    which leave the headers out, or count them apart."""
    return bool(getattr(_issuing, "header", False))


def uses_headers(group: dist.ProcessGroup) -> bool:
    """Whether collectives on ``group`` (an engine group or its user group) send headers."""
    headers = _HEADERS.get(group)
    return headers is not None and headers.on


def agree(
    group: dist.ProcessGroup,
    what: str,
    *,
    numel: int = 0,
    dtype: torch.dtype | None = None,
    phase: str = "",
    sync: bool | None = None,
) -> None:
    """[Note: collective headers] Before issuing ``what`` on ``group`` (an engine group or the user
    group it serves): check that every rank is about to issue the same collective (``what``, the
    ``phase`` it runs in, its element count and dtype); else raise :class:`CollectiveIntegrityError`
    on every rank, naming each rank's (``sync``: the group's gradient sync, named in the message
    where it differs). A no-op where the group has no headers (NCCL, W = 1, off)."""
    headers = _HEADERS.get(group)
    if headers is None or not headers.on:
        return
    pg, W = headers.group, headers.group.size()
    kind = phase_kind(phase)  # "in the forward (2nd since the last backward) of step 3": "forward"
    fields = [_crc(what), _crc(kind), numel, _crc(str(dtype)), -1 if sync is None else int(sync)]
    mine = torch.tensor(fields, dtype=torch.int64)
    everyone = torch.empty(W * _HEADER_FIELDS, dtype=torch.int64)
    with _as_header():
        work = cast(dist.Work, _all_gather(everyone, mine, group=pg, async_op=True))
    wait(work, f"the header of {what}", pg)
    rows = everyone.view(W, _HEADER_FIELDS).tolist()
    if all(row == fields for row in rows):
        return
    said: list[Any] = [None] * W  # every rank saw the same rows: all of them exchange their descriptions
    with _as_header():
        dist.all_gather_object(said, (what, phase, numel, str(dtype), sync), group=pg)
    _FAILED.add(headers.engine)  # this rank raised: check_finished has nothing to add
    raise CollectiveIntegrityError(header_mismatch(said, pg.rank()))


def agree_call(group: dist.ProcessGroup | None, call: str) -> None:
    """[Note: collective headers] At the start of the public call ``call`` (e.g.
    ``"blockshard.load_checkpoint"``), which issues collectives of its own (some on the default
    group): every rank of ``group`` (default: the default group) makes it now; else every rank raises."""
    group = dist.group.WORLD if group is None else group
    if group is not None:
        agree(group, _ENTRY + call)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


_ENTRY = "a call of "  # how agree_entry's descriptions begin: a public call, not a collective


def header_mismatch(said: list[tuple[str, str, int, str, bool | None]], rank: int) -> str:
    """The message for headers that differ ([Note: collective headers]): each rank's collective
    and the likely cause."""

    def shown(r: int) -> str:
        what, phase, numel, dtype, _ = said[r]
        size = "" if what.startswith(_ENTRY) else f" ({numel} elements of {dtype.removeprefix('torch.')})"
        return f"rank {r}: {what}{size}{' ' + phase if phase else ''}"

    W = len(said)
    ranks = ", ".join(shown(r) for r in range(W))
    kinds = [phase_kind(phase) for _, phase, _, _, _ in said]
    causes = []
    calls = {r: what[len(_ENTRY) :] for r, (what, *_) in enumerate(said) if what.startswith(_ENTRY)}
    if calls and len(calls) < W:
        for call in sorted(set(calls.values())):
            on = [r for r, c in calls.items() if c == call]
            causes.append(f"{call} was called on rank{'s' if len(on) > 1 else ''} {', '.join(map(str, on))} only")
    if "forward" in kinds and "backward" in kinds:
        fwd = [r for r, k in enumerate(kinds) if k == "forward"]
        causes.append(
            f"rank{'s' if len(fwd) > 1 else ''} {', '.join(map(str, fwd))} ran a forward where the others ran the "
            "backward: an extra forward on those ranks (e.g. an evaluation under torch.no_grad() on some ranks "
            "only) or a backward() they skipped"
        )
    if "end" in kinds and "backward" in kinds:
        done = [r for r, k in enumerate(kinds) if k == "end"]
        causes.append(
            f"rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} finished the backward with fewer "
            "collectives: a module that did not run there, or gradient sync off there"
        )
    syncs = {r: s for r, (*_, s) in enumerate(said) if s is not None}
    if len(set(syncs.values())) > 1:
        off = [r for r, s in syncs.items() if not s]
        causes.append(
            f"gradient sync is off on rank{'s' if len(off) > 1 else ''} {', '.join(map(str, off))} only "
            "(set_requires_gradient_sync(False) on some ranks)"
        )
    if not causes:
        causes.append(
            "the ranks ran different modules or passes (a module unused on some ranks, data-dependent control "
            "flow, other requires_grad flags)"
        )
    return (
        f"blockshard: the ranks' collectives do not line up (seen on rank {rank} of {W}): {ranks}. Likely cause: "
        f"{'; '.join(causes)}. Nothing was exchanged: every rank raises here instead of pairing buffers of other "
        "sizes (which aborts the process). Fix: run the same forward, backward and optimizer step on every rank, "
        "with the same modules, gradient sync and trainable parameters, and call checkpoint and state-dict "
        "functions on every rank"
    )


def wait(work: dist.Work, what: str, group: dist.ProcessGroup) -> None:
    """Wait for ``work`` at most :func:`collective_timeout_s`; a timeout or a failed peer raises
    :class:`CollectiveIntegrityError` naming ``what`` (the group and the phase) and the peers."""
    timeout = collective_timeout_s()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise failure(what, group, e, timeout) from e


def failure(what: str, group: dist.ProcessGroup, exc: BaseException, timeout: float) -> CollectiveIntegrityError:
    """The error for a collective ``what`` that failed with ``exc`` (point 2 of the Note)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    rank, W = group.rank(), group.size()
    engine_ref = _HEADER_ENGINE.get(group)  # a header's failure is reported in its engine group's store
    engine = (engine_ref() if engine_ref is not None else None) or group
    for user, mine in list(_ENGINE_GROUPS.items()):  # a failed gloo group stays broken: fully_shard makes anew
        if mine is engine:
            del _ENGINE_GROUPS[user]
    peers = _peer_reports(engine, f"{what}: {first[:200]}")  # the headers' peers report there too
    return CollectiveIntegrityError(
        f"blockshard: {what} on rank {rank} of {W} did not complete ({first}; waited at most {timeout:g} s, "
        f"{TIMEOUT_ENV}).{peers} A peer rank failed or exited, or the ranks' collectives do not line up: every "
        "rank must run the same forward and backward passes, over the same modules, with the same requires_grad "
        f"flags, in every step. If a rank legitimately works alone that long (e.g. rank 0 saves a checkpoint "
        f"while the others wait), raise {TIMEOUT_ENV}"
    )


def _peer_reports(group: dist.ProcessGroup, mine: str) -> str:
    """Report this rank's failure in the group's store and read the peers' reports (at most
    ``_REPORT_WAIT_S``): a sentence naming who failed and who never reported; "" if the store is
    unreachable (the master rank of a TCPStore died)."""
    rank, W = group.rank(), group.size()
    _FAILED.add(group)
    try:
        store = group.get_group_store()
        store.set(f"{_REPORT_PREFIX}{rank}", mine)
        others = [r for r in range(W) if r != rank]
        deadline = time.monotonic() + _REPORT_WAIT_S
        while True:
            reported = [r for r in others if store.check([f"{_REPORT_PREFIX}{r}"])]
            if len(reported) == len(others) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        said = {r: store.get(f"{_REPORT_PREFIX}{r}").decode(errors="replace") for r in reported}
    except Exception:  # the store is gone with a dead master: report without the peers
        return ""
    silent = [r for r in others if r not in said]
    parts = [f"rank {r} failed in {text}" for r, text in sorted(said.items())]
    if silent:
        parts.append(
            f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of the group never reported a "
            f"failure within {_REPORT_WAIT_S:g} s: exited, killed, or stuck outside blockshard (e.g. a skipped step)"
        )
    return " Peers: " + "; ".join(parts) + "."


def note_step(group: dist.ProcessGroup) -> None:
    """One end-of-step check ran on ``group`` (point 4 of the Note)."""
    if group.size() > 1:
        _STEPS[group] = _STEPS.get(group, 0) + 1


def check_finished() -> None:
    """Call on every rank after training (point 4 of [Note: collective integrity]): raise
    :class:`CollectiveIntegrityError` unless every rank of every group this rank trained on ran
    as many steps and none failed. Waits at most the collective timeout plus 2 s for the peers."""
    for group in list(_STEPS):
        if group in _FAILED:
            continue  # this rank raised already
        rank, W, mine = group.rank(), group.size(), _STEPS[group]
        gen = _FINISHED.get(group, 0)
        _FINISHED[group] = gen + 1
        try:
            store = group.get_group_store()
            store.set(f"{_DONE_PREFIX}{gen}/{rank}", str(mine))
        except Exception:  # the store is gone (its master rank exited): nothing left to compare with
            continue
        _wait_for_peers(store, gen, rank, W, mine, collective_timeout_s() + 2.0)


def _wait_for_peers(store: dist.Store, gen: int, rank: int, W: int, mine: int, bound: float) -> None:
    others = [r for r in range(W) if r != rank]
    deadline = time.monotonic() + bound
    done: dict[int, int] = {}
    while True:
        for r in others:
            if store.check([f"{_REPORT_PREFIX}{r}"]):
                text = store.get(f"{_REPORT_PREFIX}{r}").decode(errors="replace")
                raise CollectiveIntegrityError(
                    f"blockshard: rank {r} of {W} failed ({text}) while this rank (rank {rank}) finished training "
                    f"after {mine} steps: the ranks did not run the same steps (a rank that skips a whole step "
                    "finishes first, and its peers' last step has no partner). Fix: run the same steps on every rank"
                )
            if r not in done and store.check([f"{_DONE_PREFIX}{gen}/{r}"]):
                done[r] = int(store.get(f"{_DONE_PREFIX}{gen}/{r}"))
        if len(done) == len(others):
            break
        if time.monotonic() >= deadline:
            missing = [r for r in others if r not in done]
            raise CollectiveIntegrityError(
                f"blockshard: this rank (rank {rank} of {W}) finished training after {mine} steps, but ranks "
                f"{missing} did not finish within {bound:g} s: they are still training (they ran more steps), "
                f"stuck, or exited without blockshard.check_finished(). Fix: run the same steps on every rank "
                f"and call check_finished() on every rank (or raise {TIMEOUT_ENV} if a rank legitimately "
                "finishes later)"
            )
        time.sleep(0.02)
    differ = {r: n for r, n in done.items() if n != mine}
    if differ:
        shown = ", ".join(f"rank {r}: {n}" for r, n in sorted({**done, rank: mine}.items()))
        raise CollectiveIntegrityError(
            f"blockshard: the ranks finished training after different numbers of steps ({shown}). Fix: run the "
            "same steps on every rank"
        )


_skipped = threading.local()  # [Note: one rank]: this thread's watchers of the collectives not issued


@contextlib.contextmanager
def watch_skipped(hook: Callable[[str, tuple[torch.Tensor, ...]], None]) -> Iterator[None]:
    """[Note: one rank] While inside, ``hook(kind, tensors)`` sees each collective this thread did
    not issue because its group has one rank (``kind``: ``"all_gather"``, ``"reduce_scatter"`` or
    ``"all_reduce"``; ``tensors``: the output and the input, as c10d's ops take them), so a tool
    that follows the engine's schedule through c10d's ops sees it at W = 1 too."""
    hooks = getattr(_skipped, "hooks", [])
    _skipped.hooks = [*hooks, hook]
    try:
        yield
    finally:
        _skipped.hooks = hooks


def _skip(kind: str, *tensors: torch.Tensor) -> None:
    for hook in getattr(_skipped, "hooks", ()):
        hook(kind, tensors)


class _Done(dist.Work):
    """A collective that completed where it was issued ([Note: one rank])."""

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE: dist.Work = _Done()


def all_reduce_in_place(t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup, what: str) -> None:
    """All-reduce ``t`` (SUM, AVG or MAX) over ``group`` and wait (bounded, :func:`wait`); over one
    rank ``t`` is already the result: nothing is issued ([Note: one rank])."""
    if group.size() == 1:
        _skip("all_reduce")
        return
    wait(dist.all_reduce(t, op=op, group=group, async_op=True), what, group)


def holds_copies(process_group: dist.ProcessGroup, device: torch.device) -> bool:
    """[Note: gloo's copies] Whether asynchronous collectives on ``process_group`` work on copies
    of their own: gloo on the CPU, with W > 1."""
    return device.type == "cpu" and process_group.size() > 1 and dist.get_backend(process_group) == "gloo"


def _wire(t: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes: gloo has no float8 ("Invalid scalar type"); moving bytes is exact."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


@overload
def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: Literal[True]
) -> dist.Work: ...
@overload
def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: Literal[False] = False
) -> None: ...
def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
) -> dist.Work | None:
    assert out.numel() == inp.numel() * group.size() and out.dtype == inp.dtype, (out.shape, inp.shape)
    if group.size() == 1:  # [Note: one rank]
        out.copy_(inp.reshape(out.shape) if inp.numel() else inp)
        _skip("all_gather", out, inp)
        return DONE if async_op else None
    return _all_gather(_wire(out), _wire(inp), group=group, async_op=async_op)


@overload
def reduce_scatter_avg(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: Literal[True], summed: bool = False
) -> dist.Work: ...
@overload
def reduce_scatter_avg(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: Literal[False] = False,
    summed: bool = False,
) -> None: ...
def reduce_scatter_avg(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False, summed: bool = False
) -> dist.Work | None:
    """The average over ranks (``summed``: the sum, for a custom divide factor)."""
    assert inp.numel() == out.numel() * group.size() and out.dtype == inp.dtype, (out.shape, inp.shape)
    if group.size() == 1:  # [Note: one rank]: the average (and the sum) over one rank is its own value
        if out.data_ptr() != inp.data_ptr() or out.numel() == 0:  # the engine may reduce in place
            out.copy_(inp.reshape(out.shape) if inp.numel() else inp)
        _skip("reduce_scatter", out, inp)
        return DONE if async_op else None
    op = dist.ReduceOp.SUM if summed else dist.ReduceOp.AVG
    return _reduce_scatter(out, inp, op=op, group=group, async_op=async_op)


def check_same_layout(group_name: str, layout_hash: str, group: dist.ProcessGroup) -> None:
    """Raise :class:`LayoutMismatchError` on every rank unless all ranks computed ``layout_hash``."""
    if group.size() == 1:
        return  # [Note: one rank]
    mine = (group_name, layout_hash)
    everyone: list[Any] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        by_rank = ", ".join(f"rank {r}: group {n!r} hash {h}" for r, (n, h) in enumerate(everyone))
        raise LayoutMismatchError(
            f"fully_shard: ranks disagree on the layout of group {group_name!r} ({by_rank}). Every rank "
            "must shard the same model with the same semantics, alignment and world size, in the same "
            "order (bottom-up, identical fully_shard calls)"
        )


def shift_ranks(local: torch.Tensor, k: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Rank ``r``'s ``local`` moves to rank ``(r + k) % W``: returns what this rank receives.

    One ``all_to_all_single`` with a single non-empty split each way (a layout rotation, once,
    before training).
    """
    W, r, n = group.size(), group.rank(), local.numel()
    send, recv = [0] * W, [0] * W
    send[(r + k) % W], recv[(r - k) % W] = n, n
    out = torch.empty_like(local)
    dist.all_to_all_single(_wire(out), _wire(local), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def step_mismatch(name: str, rows: list[list[int]], never: int = -1) -> str:
    """What differs between the ranks' end-of-step records (step, collectives, order, trainable,
    gradients received, optimizer steps; ``never`` in the last: a rank holding nothing to step,
    left out)."""
    what = []
    labels: tuple[str, ...] = ("step", "collectives issued", "collective order", "requires_grad flags")
    labels += ("parameters with a gradient", "optimizer steps")
    last = len(labels) - 1
    for col, label in enumerate(labels):
        values = [row[col] for row in rows]
        if len(set(values) - ({never} if col == last else set())) > 1:
            shown = (
                ", ".join(f"rank {r}: {'-' if v == never and col == last else v}" for r, v in enumerate(values))
                if col in (0, 1, last)
                else "differ"
            )
            what.append(f"{label} ({shown})")
    return (
        f"blockshard: the ranks' collectives for the model rooted at group {name!r} did not line up in this "
        f"step: {'; '.join(what)}. A rank skipped a step or ran an extra forward, left a module unused, or "
        "has other requires_grad flags, or a rank skipped optimizer.step(); the gradients of "
        "this step are not the average of the ranks' and must not be used. Fix: run the same forward, "
        "backward and optimizer step on every rank, with the same modules and the same trainable parameters; "
        "where the ranks' control flow uses different parameters (mixture of experts), "
        "module.set_reduce_scatter_unused_params(True) gives every rank the reduced gradient of each"
    )
