"""Reading a JSON file a user gave: every failure is a ValueError that names the file and what to fix.

``json`` alone reports "Expecting value: line 1 column 1" without the file, a directory as
``IsADirectoryError``, deep nesting as ``RecursionError``: none of them says which input was bad."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

PairsHook = Callable[[list[tuple[str, Any]]], Any]


def read_json(path: str | os.PathLike, what: str, object_pairs_hook: PairsHook | None = None) -> Any:
    """The parsed contents of ``path`` (``what`` names it in errors: "config file", "lengths file");
    FileNotFoundError when it does not exist, ValueError for everything else that is wrong with it."""
    where = os.fspath(path)
    if os.path.isdir(where):
        raise ValueError(f"{what} {where} is a directory; give a JSON file")
    try:
        with open(where, encoding="utf-8") as f:
            return json.load(f, object_pairs_hook=object_pairs_hook)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {where} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} {where} is nested too deeply to be a JSON config or list") from None
