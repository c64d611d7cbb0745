"""Reads a checkpoint's JSON files (config.json, tokenizer_config.json, index files) with one-line
errors that name the file, instead of a bare JSONDecodeError naming none."""

from __future__ import annotations

import json


def load_json_file(path: str, what: str = "JSON file"):
    """The parsed contents of ``path``; ValueError naming the file when it is missing, unreadable or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is corrupt (not valid JSON: {e})") from None
    except RecursionError:
        raise ValueError(f"{what} {path} is corrupt (nested too deeply)") from None
