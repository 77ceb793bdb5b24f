"""Local gloo ranks for examples, tests and quick experiments: ``spawn_gloo(fn, world_size)`` runs
``fn(rank, world_size)`` on spawned processes, each in an initialised gloo process group, and
``run_single(fn)`` runs it as one process (the reference a sharded run is compared with). Under
``torchrun``, initialise the process group yourself and call ``fn`` directly.

``BLOCKSHARD_SPAWN_METHOD=forkserver`` forks the ranks from one server process that imported torch
once, instead of starting each with a fresh interpreter ("spawn", the default): many short runs
start far faster (the test suite sets it). Each rank gets the caller's environment variables and
working directory as of the call under either method."""

from blockshard._launch import run_single, spawn_gloo

__all__ = ["run_single", "spawn_gloo"]
