"""What every benchmark does with its report: print the table, write ``--out``, print ``--json``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def emit(report: dict, *, render: Callable[[dict], None], out: str | None, as_json: bool) -> dict:
    render(report)
    text = json.dumps(report, indent=2)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text + "\n")
    if as_json:
        print(text)
    return report
