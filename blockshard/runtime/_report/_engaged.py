"""The line an integration logs when blockshard engages, and the report after it.

[Note: engage line]
The Accelerate plugin (at the end of ``prepare``), the HF Trainer (through the same plugin) and the
DeepSpeed hook (at the end of ``blockshard.integrations.deepspeed.initialize``) call
:func:`log_engaged`. Under ``BLOCKSHARD_LOG=info`` ([Note: traffic] in runtime/core/_traffic.py)
every rank builds :func:`~blockshard.report` (a collective: the launcher gives every rank the same
environment) and rank 0 logs one line, ``blockshard engaged (<source>): engine ..., semantics ...,
policy ..., N groups over W ranks``, then the report's tables, to the ``blockshard`` logger at
INFO. Without it nothing is computed or said.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from blockshard._errors import BlockshardError
from blockshard.runtime._report._build import report
from blockshard.runtime.core._traffic import log_on, logger

__all__ = ["log_engaged"]


def log_engaged(
    model: nn.Module,
    source: str,
    *,
    engine: str,
    semantics: object,
    policy: str,
    optimizers: Sequence[object] = (),
    with_report: bool = True,
) -> None:
    """[Note: engage line] Log that blockshard engaged on ``model`` and its report (every rank calls
    it; ``with_report=False``: the line alone, for engines the report does not read: DeepSpeed ZeRO-3)."""
    if not log_on():
        return
    if not with_report:
        W = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if W == 1 or dist.get_rank() == 0:
            said = semantics if isinstance(semantics, str) else repr(semantics)
            s = "" if W == 1 else "s"
            logger.info(
                "blockshard engaged (%s): engine %s, semantics %s, policy %s, over %d rank%s",
                source,
                engine,
                said,
                policy,
                W,
                s,
            )
        return
    from rich.console import Console

    try:
        rep = report(model, optimizers=list(optimizers))
    except BlockshardError as e:  # every rank alike (the report's rows are gathered): say so, do not stop prepare
        logger.warning("blockshard engaged (%s), but its report could not be built: %s", source, e)
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    groups = len(rep.groups)
    logger.info(
        "blockshard engaged (%s): engine %s, semantics %s, policy %s, %d group%s over %d rank%s",
        source,
        engine,
        semantics if isinstance(semantics, str) else repr(semantics),
        policy,
        groups,
        "" if groups == 1 else "s",
        rep.world_size,
        "" if rep.world_size == 1 else "s",
    )
    out = io.StringIO()
    rep.render(Console(file=out, width=200, force_terminal=False, color_system=None))
    logger.info("blockshard report at the end of %s:\n%s", source, out.getvalue().rstrip())
