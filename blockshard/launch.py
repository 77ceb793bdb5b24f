"""Local gloo ranks for examples, tests and quick experiments: ``spawn_gloo(fn, world_size)`` runs
``fn(rank, world_size)`` on spawned processes, each in an initialised gloo process group, and
``run_single(fn)`` runs it as one process (the reference a sharded run is compared with). Under
``torchrun``, initialise the process group yourself and call ``fn`` directly."""

from blockshard._launch import run_single, spawn_gloo

__all__ = ["run_single", "spawn_gloo"]
