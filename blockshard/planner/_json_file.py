"""Reading the JSON files users pass (config.json, shapes files), with errors that name the file and the fix."""

from __future__ import annotations

import json
import os
from typing import Any

from blockshard._errors import ShapesError
from blockshard._limits import MAX_JSON_BYTES

__all__ = ["read_json_file"]


def read_json_file(p: str, what: str, *, missing_fix: str, format_fix: str) -> Any:
    """``json.load`` of ``p`` with a :class:`ShapesError` naming the file, the problem and the fix.

    Files over ``MAX_JSON_BYTES`` are refused before reading (``json.load`` holds ~8x the file)."""
    try:
        with open(p, encoding="utf-8") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise ShapesError(
                    f"{what} {p!r} is {size / 2**20:,.1f} MiB, more than the {MAX_JSON_BYTES // 2**20} MiB "
                    "blockshard reads; plan a part of the model (some layers) at a time"
                )
            return json.load(f)
    except ShapesError:
        raise
    except FileNotFoundError:
        raise ShapesError(f"{what} {p!r} does not exist; {missing_fix}") from None
    except IsADirectoryError:
        raise ShapesError(f"{what} {p!r} is a folder, not a file; {missing_fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ShapesError(f"{what} {p!r} cannot be read ({e}); check the path") from None
    except json.JSONDecodeError as e:
        raise ShapesError(
            f"{what} {p!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {format_fix}"
        ) from None
    except RecursionError:
        raise ShapesError(
            f"{what} {p!r} nests JSON arrays or objects too deeply for Python's parser (thousands of "
            f"levels); {format_fix}"
        ) from None
    except ValueError as e:  # e.g. an integer with more than 4300 digits
        raise ShapesError(f"{what} {p!r} cannot be parsed ({e}); {format_fix}") from None
