"""``MuonWithAdamW``: torch's Muon and torch's AdamW as one optimizer, by param_group.

[Note: Muon beside AdamW]
Muon steps the hidden matrices; embeddings, the head, norms and biases take AdamW. Code that takes
*one* optimizer (a DeepSpeed engine, the HF Trainer's ``optimizer_cls_and_kwargs``, a scheduler)
needs both in one object. :class:`MuonWithAdamW` is ``torch.optim.Muon`` on the param_groups marked
``use_muon=True`` (or ``"optimizer": "muon"``, as :func:`~blockshard.optim.muon_param_groups` marks
them) and ``torch.optim.AdamW`` on the others. It holds one ``param_groups`` list (each group with
its optimizer's hyperparameters and defaults) and one ``state``; ``step`` hands each group to the
optimizer it is marked for, as it is at that moment (engines replace a group's ``params``), so the
update is bitwise ``torch.optim.Muon`` and ``torch.optim.AdamW`` run side by side.

Block semantics per group (:meth:`MuonWithAdamW.blockshard_group_semantics`): ``"matrix"`` for
Muon's groups, ``"elementwise"`` for AdamW's. blockshard's DeepSpeed ZeRO-3 hook reads them, so
Muon's matrices are stepped whole at their owners and AdamW's parameters where DeepSpeed's partitions
lie (no bytes moved); DeepSpeed's own ``MuonWithAuxAdam`` (which steps DeepSpeed's flat partitions)
stays refused by the hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from blockshard._errors import BlockshardError
from blockshard.optim._placeholders import construct_over_stand_ins
from blockshard.optim._semantics import muon_param_groups
from blockshard.optim._step import closure_loss

__all__ = ["MuonWithAdamW"]

_MARKS = {"muon": True, "adamw": False}


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's ``Muon`` on the param_groups marked ``use_muon=True`` (or ``"optimizer": "muon"``),
    torch's ``AdamW`` on those marked ``use_muon=False`` (or ``"optimizer": "adamw"``).

    ``params``: param_groups (dicts); each must be marked. ``muon`` / ``adamw``: the keyword arguments
    of ``torch.optim.Muon`` / ``torch.optim.AdamW`` (their defaults where left out); a group's own
    keys override them, as in any torch optimizer::

        opt = MuonWithAdamW(muon_param_groups(model), muon={"lr": 0.02}, adamw={"lr": 1e-3})

    See [Note: Muon beside AdamW].
    """

    def __init__(
        self,
        params: Iterable[Mapping[str, Any]],
        *,
        muon: Mapping[str, Any] | None = None,
        adamw: Mapping[str, Any] | None = None,
    ) -> None:
        listed = [params] if isinstance(params, Mapping) else list(params)  # one group given alone, too
        groups = [dict(g) if isinstance(g, Mapping) else g for g in listed]
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                raise BlockshardError(
                    f"MuonWithAdamW(params=...): item {i} is a {type(g).__name__}, not a param_group dict. Fix: pass "
                    "param_groups marked use_muon=True / False, e.g. blockshard.optim.muon_param_groups(model)"
                )
            g["use_muon"] = _use_muon(i, g)
        if not groups:
            raise BlockshardError(
                "MuonWithAdamW(params=...) got no param_groups. Fix: pass a list of param_group dicts marked "
                "use_muon=True / False, e.g. blockshard.optim.muon_param_groups(model)"
            )
        muon_kw, adamw_kw = dict(muon or {}), dict(adamw or {})
        muon_groups = [g for g in groups if g["use_muon"]]
        try:  # torch's own checks of the arguments and its defaults, filled into each group
            self._muon = construct_over_stand_ins(
                lambda args: torch.optim.Muon(args or [_empty()], **muon_kw), muon_groups
            )
            self._adamw = torch.optim.AdamW([g for g in groups if not g["use_muon"]] or [_empty()], **adamw_kw)
        except TypeError as exc:
            raise BlockshardError(
                f"MuonWithAdamW(muon={muon_kw}, adamw={adamw_kw}): {exc}. Fix: pass torch.optim.Muon's keyword "
                "arguments in muon= and torch.optim.AdamW's in adamw="
            ) from None
        for g, filled in zip(muon_groups, self._muon.param_groups if muon_groups else [], strict=True):
            g.update(filled)  # Muon's defaults, over the real parameters (it was built over stand-ins)
        super().__init__(groups, {})
        self._sync()

    def _sync(self) -> None:
        """The two optimizers see this one's groups and state, as they are now."""
        self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
        self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._muon.state = self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        self._sync()
        if self._muon.param_groups:
            self._muon.step()
        if self._adamw.param_groups:
            self._adamw.step()
        return loss

    @classmethod
    def for_model(cls, model: nn.Module, *, experts: bool = True) -> type[MuonWithAdamW]:
        """For code that builds the optimizer class from param_groups of its own (the HF Trainer's
        ``optimizer_cls_and_kwargs``): a subclass whose constructor takes any param_groups (or a
        parameter list) and splits each group into the parameters
        :func:`~blockshard.optim.muon_param_groups` gives Muon (``model``'s hidden matrices, by
        identity) and the rest (AdamW), each part keeping the group's own keys (the Trainer's
        ``weight_decay``)::

            Trainer(..., optimizer_cls_and_kwargs=(MuonWithAdamW.for_model(model),
                                                   {"muon": {"lr": 0.02}, "adamw": {"lr": 1e-3}}))
        """
        muon_ids = frozenset(id(p) for p in muon_param_groups(model, experts=experts)[0]["params"])

        class ForModel(cls):  # type: ignore[valid-type,misc]
            def __init__(self, params: Any, **kwargs: Any) -> None:
                super().__init__(_split(params, muon_ids), **kwargs)

        ForModel.__name__ = ForModel.__qualname__ = cls.__name__  # what logs and checks name
        return ForModel

    def blockshard_group_semantics(self, index: int) -> str:
        """The block semantics of param_group ``index``: Muon's whole matrices or AdamW's elements."""
        return "matrix" if self.param_groups[index]["use_muon"] else "elementwise"


def _use_muon(i: int, group: Mapping[str, Any]) -> bool:
    mark, name = group.get("use_muon"), group.get("optimizer")
    if isinstance(mark, bool) and (name is None or _MARKS.get(str(name).lower()) == mark):
        return mark
    if mark is None and isinstance(name, str) and name.lower() in _MARKS:
        return _MARKS[name.lower()]
    raise BlockshardError(
        f"MuonWithAdamW: param_group {i} is marked use_muon={mark!r}, optimizer={name!r}; each group needs "
        "use_muon=True (Muon) or False (AdamW), or 'optimizer': 'muon' / 'adamw' (and the two must agree). Fix: "
        "mark every group, e.g. take the groups from blockshard.optim.muon_param_groups(model)"
    )


def _split(params: Any, muon_ids: frozenset[int]) -> list[dict[str, Any]]:
    """``params`` (param_groups or a parameter list) as marked groups: each group's Muon part (its
    parameters in ``muon_ids``) and AdamW part, with the group's own keys."""
    listed = list(params)
    given = listed if listed and all(isinstance(g, Mapping) for g in listed) else [{"params": listed}]
    groups: list[dict[str, Any]] = []
    for g in given:
        keys = {k: v for k, v in g.items() if k not in ("params", "param_names", "use_muon", "optimizer")}
        members = list(g["params"])
        for use_muon in (True, False):
            part = [p for p in members if (id(p) in muon_ids) == use_muon]
            if part:
                groups.append({**keys, "params": part, "use_muon": use_muon})
    return groups


def _empty() -> dict[str, Any]:
    return {"params": []}
