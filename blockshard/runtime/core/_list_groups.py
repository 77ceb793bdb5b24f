"""``fully_shard([a, b])``: one group over the parameters of several modules, as FSDP2's.

[Note: a list of modules]
``fully_shard([norm, head])`` (torch 2.13, ``_fully_shard.py`` and ``_fsdp_state.py``) makes one
group over the parameters of every listed module (a module inside another listed one is
covered by it; already sharded submodules keep their own groups). As in FSDP2, every listed
module gets the class swap and the state, pre- and post-forward hooks run on each; the
argument (the list) is returned. In one forward pass the first listed module to run gathers the
group (and is the one that records the forward order and prefetches); later ones find it
gathered; the group reshards after the *last* of them has run, or, when the pass runs only some
of them (chunked loss: the model's forward runs ``norm``, ``head`` is called per chunk later),
at the end of the root's forward, as FSDP2's ``_force_complete_incomplete_states``. Every
module's inputs are hooked for the post-backward ([Note: post-backward] in _state.py), so the
group reduces once, after the last of them. A pass cut short (only ``head`` called, after the
root's forward) is still a forward of the group: its pre-backward starts the group's backward.

Names: the group's tensors are named relative to the modules' lowest common ancestor, as
``model.named_parameters()`` names them (``model.norm.weight``, ``lm_head.weight``), which is
known only once the modules' parent is: at ``fully_shard`` of a module that encloses them all
(usually the root), or when an inspection (``blockshard.full_state_dict(model)``) first sees
them all under ``model``. Until then they are ``0.weight``, ``1.weight``... (the module's
position in the list), also the names ``semantics`` rules see. Owner-computed tensors
(``policy="owner"`` or ``"auto"`` choosing it) are not supported in a list's group yet.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.core._state import ModuleState, state_of

__all__ = ["bind_below", "bind_names", "collect_all", "listed_modules"]


def listed_modules(modules: object) -> tuple[nn.Module, ...]:
    """The modules of ``fully_shard([...])`` that are no submodule of another listed one, in order
    (FSDP2's ``_get_root_modules``), each once."""
    if not isinstance(modules, (list, tuple)) or not modules:
        raise ShardingError(f"fully_shard(modules={modules!r}): pass a module or a non-empty list of modules")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise ShardingError(f"fully_shard: item {i} of the list is a {type(m).__name__}, not a torch.nn.Module")
    unique = list({id(m): m for m in modules}.values())
    subtrees = {id(m): {id(s) for s in m.modules()} for m in unique}
    return tuple(m for m in unique if not any(o is not m and id(m) in subtrees[id(o)] for o in unique))


def bind_names(state: ModuleState, top: nn.Module) -> bool:
    """Rename a list group's tensors relative to its modules' lowest common ancestor under ``top``
    (see [Note: a list of modules]); False if ``top`` does not hold all its modules. Every rank
    renames the same way; nothing but the names changes (offsets, pieces, buffers stay)."""
    if len(state.modules) == 1 or state.module not in state.modules:
        return True  # a single module, or bound already (``module`` is the ancestor then)
    paths: dict[int, str] = {}
    for path, m in top.named_modules():
        paths.setdefault(id(m), path)
    if any(id(m) not in paths for m in state.modules):
        return False
    parts = [paths[id(m)].split(".") if paths[id(m)] else [] for m in state.modules]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    anchor = top.get_submodule(".".join(parts[0][:common]))
    rename: dict[str, str] = {}
    for i, p in enumerate(parts):
        rel = ".".join(p[common:])
        rename |= {
            sp.fqn: f"{rel}.{sp.fqn[len(f'{i}.') :]}"
            for g in state.param_buffers
            for sp in g.params
            if sp.fqn.startswith(f"{i}.")
        }
    _rename(state, rename)
    state.module = anchor
    return True


def _rename(state: ModuleState, rename: dict[str, str]) -> None:
    for group in state.param_buffers:
        _rename_group(group, rename)


def _rename_group(group: ParamBuffers, rename: dict[str, str]) -> None:
    for sp in group.params:
        sp.fqn = rename[sp.fqn]
    group.costs = {rename.get(k, k): v for k, v in group.costs.items()}
    layout = group.layout
    if layout is not None:
        tensors = tuple(dataclasses.replace(t, name=rename.get(t.name, t.name)) for t in layout.tensors)
        group._layout = dataclasses.replace(layout, tensors=tensors)


def bind_below(module: nn.Module) -> None:
    """Name the list groups under ``module`` whose modules it all holds (fully_shard of an enclosing module)."""
    seen: set[int] = set()
    for m in module.modules():
        st = state_of(m)
        if st is not None and id(st) not in seen:
            seen.add(id(st))
            bind_names(st, module)


# -- the parameters of a group ------------------------------------------------------------------
def _collect(
    module: nn.Module, ignored: set[int] | None = None
) -> tuple[list[str], list[nn.Parameter], list[list[ParamRef]]]:
    """Parameters of ``module``'s subtree not owned by an already sharded submodule, nor ignored."""
    ignored = ignored or set()
    names: list[str] = []
    params: list[nn.Parameter] = []
    refs: dict[int, list[ParamRef]] = {}
    owned_below: dict[int, str] = {}
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if mod is not module and state_of(mod) is not None:
            for n, p in mod.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
                owned_below[id(p)] = n
            continue
        for attr, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            if id(param) not in refs:
                names.append(prefix + attr)
                params.append(param)
                refs[id(param)] = []
            refs[id(param)].append(ParamRef(mod, attr))
        for cname, child in reversed(list(mod._modules.items())):
            if child is not None:
                stack.append((f"{prefix}{cname}.", child))
    shared = [(n, owned_below[id(p)]) for n, p in zip(names, params, strict=True) if id(p) in owned_below]
    if shared:
        raise ShardingError(
            f"parameters shared between this group and an already sharded submodule: {shared[:5]}. One "
            "parameter can live in one group only. Fix: shard the modules that share it in one "
            "fully_shard call (e.g. leave the tied head and embedding to the root), or untie them"
        )
    return names, params, [refs[id(p)] for p in params]


def collect_all(
    modules: tuple[nn.Module, ...], ignored: set[int]
) -> tuple[list[str], list[nn.Parameter], list[list[ParamRef]]]:
    """:func:`_collect` over each listed module; a list's names get the module's position first
    (``0.weight``) until the group is bound ([Note: a list of modules]); a parameter tied across
    them is collected once, with every place it is registered."""
    if len(modules) == 1:
        return _collect(modules[0], ignored)
    names: list[str] = []
    params: list[nn.Parameter] = []
    refs: dict[int, list[ParamRef]] = {}
    for i, m in enumerate(modules):
        for n, p, r in zip(*_collect(m, ignored), strict=True):
            if id(p) not in refs:
                names.append(f"{i}.{n}")
                params.append(p)
                refs[id(p)] = []
            refs[id(p)].extend(r)
    return names, params, [refs[id(p)] for p in params]
