"""``RootContext``: what every module state under one root shares: the forward order (the next
step's prefetch order), the end-of-backward callback (step 5 of [Note: one step, phase by phase] in
_state.py), the reduce-scatters in flight and the end-of-step check ([Note: collective integrity]
in _collectives.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from blockshard._errors import CollectiveIntegrityError
from blockshard.runtime.core._buffer_set import BufferSet
from blockshard.runtime.core._collectives import (
    agree,
    all_gather_into,
    all_reduce_in_place,
    note_step,
    step_mismatch,
    wait,
)
from blockshard.runtime.core._common import CollectiveTally, TrainingState
from blockshard.runtime.core._optim_checks import checks_on, compare_across_ranks
from blockshard.runtime.core._traffic import log_step_summary

if TYPE_CHECKING:
    from blockshard.runtime.core._state import ModuleState

__all__ = ["RootContext"]


@dataclass(eq=False)
class RootContext:
    """Shared by every state under one root: the forward order and the end-of-backward callback."""

    states: list[ModuleState] = field(default_factory=list)  # the root first
    forward_order: list[ModuleState] = field(default_factory=list)
    last_order: list[ModuleState] = field(default_factory=list)
    last_index: dict[int, int] = field(default_factory=dict)  # id(state) -> position in last_order
    callback_queued: bool = False
    tally: CollectiveTally = field(default_factory=CollectiveTally)
    reducing: list[BufferSet] = field(default_factory=list)  # reduce-scatters in flight, oldest first
    registrations_seen: int = -1  # [Note: parameters added after fully_shard]: the count at the last look
    # [Note: first-step optimizer checks]: id(piece) -> the (optimizer, param_group) classes stepping
    # it on this rank, their texts (and whether the optimizer is element-wise), compared once
    optimizer_classes: dict[int, set[int]] = field(default_factory=dict)
    optimizer_texts: dict[int, tuple[str, bool]] = field(default_factory=dict)
    optimizers_compared: bool = False

    def finish_reductions(self) -> None:
        """Wait for the reduce-scatters in flight and set their gradients ([Note: async reduce-scatter])."""
        while self.reducing:
            self.reducing.pop(0).finish_reduce()

    def remember_order(self) -> None:
        """The forward order just recorded becomes the prefetch order of the next step."""
        if self.forward_order:
            self.last_order = self.forward_order
            self.last_index = {id(st): i for i, st in enumerate(self.last_order)}
        self.forward_order = []

    def neighbour(self, state: ModuleState, step: int) -> ModuleState | None:
        i = self.last_index.get(id(state))
        if i is None or not 0 <= i + step < len(self.last_order):
            return None
        return self.last_order[i + step]

    def final_callback(self) -> None:
        """End of backward: see step 5 of [Note: one step, phase by phase]."""
        self.callback_queued = False
        for st in self.states:
            if st.training_state is TrainingState.PRE_BACKWARD:
                st.finish_backward()  # gradients that never all arrived (unused parameters)
            if st.controls.reshard_after_backward:
                st.reshard()
            st._to_idle()
        self.finish_reductions()  # every sharded .grad is final when backward returns
        self.remember_order()
        self.check_step()

    def reset_step(self) -> None:
        """Every group resharded, every state IDLE, partial gradients and the tally dropped
        (``reset_iter_state()``, and the next forward after an interrupted step)."""
        for st in self.states:
            for b in st.buffer_sets:
                b.reset_step()
            st.reshard()
            st._to_idle()
        self.callback_queued = False
        self.reducing.clear()
        self.tally.reset()

    def _summarize(self, step: int, root: str) -> None:
        """The step's bytes by kind over every buffer set, against the plan ([Note: traffic])."""
        totals: dict[str, int] = {}
        predicted: dict[str, int] = {}
        for st in self.states:
            for b in st.buffer_sets:
                moved, planned = b.traffic.take_step()
                for kind, n in moved.items():
                    totals[kind] = totals.get(kind, 0) + n
                for kind, n in planned.items():
                    predicted[kind] = predicted.get(kind, 0) + n
        log_step_summary(root, step, totals, predicted)

    def check_step(self) -> None:
        """[Note: collective integrity] One small all-reduce per step: every rank must have issued
        the same collectives (count and order), at the same step, with the same trainable
        parameters, and every rank that steps an optimizer must have stepped as often; else every
        rank raises before the optimizer step uses the gradients."""
        tally, group = self.tally, self.states[0].buffers
        trainable, received, holds = 0, 0, False
        for st in self.states:
            for sp in (sp for g in st.param_buffers for sp in g.params):  # every buffer set's flags
                trainable = (trainable * 3 + 1 + sp.sharded.requires_grad) % CollectiveTally._MOD
                # a rank whose parameter got no gradient leaves its piece unstepped while the others step theirs
                received = (received * 3 + 1 + (sp.sharded.grad is not None)) % CollectiveTally._MOD
                holds |= sp.sharded.requires_grad and sp.sharded.numel() > 0
        pg, W = group.process_group, group.world_size
        tally.phase = "end"
        fields = [tally.steps + 1, tally.count, tally.hash, trainable, received]
        fields.append(tally.optimizer_steps + tally.optimizer_stepped)
        n = len(fields)
        what = f"the end-of-step check of the model rooted at group {group.name!r}"
        agree(pg, what, numel=2 * n, dtype=torch.int64, phase=tally.phase_text)  # [Note: collective headers]
        tally.steps += 1
        self._summarize(tally.steps, group.name)  # [Note: traffic]
        tally.optimizer_steps += tally.optimizer_stepped
        tally.optimizer_stepped = False
        note_step(pg)
        # one all-reduce (MAX) of the fields and their negatives gives every field's max and min; a
        # rank that never stepped an optimizer and holds no trainable element is left out of the
        # min (it has nothing to step); one that holds some must have stepped as often as the rest
        lows = fields[:-1] + [fields[-1] or (0 if holds else _NEVER)]
        device = next((st.buffers.device for st in self.states if st.buffers.layout is not None), None)
        extremes = torch.tensor(fields + [-v for v in lows], dtype=torch.int64, device=device)  # NCCL: on the GPU
        all_reduce_in_place(extremes, dist.ReduceOp.MAX, pg, what)  # over one rank: nothing to compare
        tally.reset()
        top = extremes.tolist()
        highs, mins = top[:n], [-v for v in top[n:]]
        if highs[:-1] == mins[:-1] and mins[-1] in (highs[-1], _NEVER):
            if highs[-1] >= 1 and not self.optimizers_compared:  # every rank knows: some optimizer stepped
                self.optimizers_compared = True
                if checks_on():
                    compare_across_ranks(self, pg)
            return
        mine = torch.tensor(lows, dtype=torch.int64, device=device)
        everyone = torch.empty(W * n, dtype=torch.int64, device=device)  # every rank saw the mismatch: the details
        wait(all_gather_into(everyone, mine, pg, async_op=True), what, pg)
        rows = everyone.view(W, n).tolist()
        raise CollectiveIntegrityError(step_mismatch(group.name, rows, never=_NEVER))


_NEVER = 1 << 62  # "never stepped an optimizer", in the min of the end-of-step check
