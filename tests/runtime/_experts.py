"""One process's Muon on stacked experts, shared by the in-process and spawned expert tests: torch's
own Muon on every expert's 2-D ``(m, n)`` matrix (views of the stacked tensor and of its gradient);
``per_expert=False``, the control: on the stack flattened to ``(E * m, n)``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: The stacked expert tensors of blockshard._tiny.tiny_mixtral.
EXPERTS = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]


def per_expert_muon(
    model: nn.Module, muon_lr: float, adamw_lr: float, per_expert: bool = True
) -> tuple[list[torch.optim.Optimizer], Callable[[], None]]:
    """torch's Muon (the matrices, each expert's one at a time) and AdamW (the rest), and the hook
    to call between backward and the steps: it moves each stack's gradient onto its views."""
    from blockshard.optim import muon_param_groups

    muon_group, rest = muon_param_groups(model)
    named = dict(zip(muon_group["param_names"], muon_group["params"], strict=True))
    stacks = [named.pop(n) for n in EXPERTS]
    with torch.no_grad():
        views = [[w[e] for e in range(w.shape[0])] if per_expert else [w.view(-1, w.shape[-1])] for w in stacks]
    muon = torch.optim.Muon([*named.values(), *(v for vs in views for v in vs)], lr=muon_lr)

    def grads_to_views() -> None:
        for w, vs in zip(stacks, views, strict=True):
            for v, g in zip(vs, w.grad if per_expert else [w.grad.view(-1, w.shape[-1])], strict=True):
                v.grad = g
            w.grad = None  # the stacked tensor itself is in no optimizer

    return [muon, torch.optim.AdamW([rest], lr=adamw_lr)], grads_to_views
