"""A user's YAML file, read strictly: one-line errors for a missing, unreadable, non-UTF-8 or malformed
file, and for a key given twice in one mapping (plain YAML keeps the last one silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from digenrl.errors import UserError, read_user_text


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise UserError(
                f"{loader.name}: key '{key}' appears twice in one mapping "
                f"(line {key_node.start_mark.line + 1})"
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def parse_yaml(path: Path, what: str) -> Any:
    """A user's YAML file: one-line errors for a missing, unreadable, non-UTF-8 or malformed file and
    for a duplicate key. ``what`` names the option or field that named the file."""
    path = Path(path)
    text = read_user_text(path, what)
    loader = _UniqueKeyLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(exc, "problem", "") or "")
        if "recursive" in problem:  # an alias inside its own anchor: a structure that contains itself
            raise UserError(
                f"{path}: a recursive YAML anchor (an alias used inside its own anchor){where}"
            ) from None
        if isinstance(exc, yaml.constructor.ConstructorError):  # e.g. a !!python tag SafeLoader refuses
            raise UserError(f"{path}: unsupported YAML{where} ({problem.split(';')[0].strip()})") from None
        raise UserError(f"{path}: malformed YAML{where}") from None
    finally:
        loader.dispose()
