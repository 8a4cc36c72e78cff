"""A user's YAML file, read strictly: one-line errors for a missing, unreadable, non-UTF-8 or malformed
file, and for a key given twice in one mapping (plain YAML keeps the last one silently)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from digenrl.errors import RELATIVE, UserError, read_user_text


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


#: a run config's input paths: relative ones are read from the config file's folder (output.run_dir,
#: where the run writes, stays relative to the working directory, as runs/ does)
INPUT_PATHS = (("model", "pretrained"), ("prompts", "file"))
#: the ``args`` of a reward component that name files or directories (the model rewards')
REWARD_PATH_ARGS = ("path", "processor_path", "head", "tokenizer")


def rebase_paths(data: dict, config: Path | None) -> None:
    """Make the relative input paths of config file ``config``'s ``data`` absolute, against the file's
    folder (in place), so that a config runs from any working directory; ``None``: ``--set``'s, against
    the working directory (so a run's saved config.yaml reads them from there too). Each is remembered
    for the "not found" line (:func:`digenrl.errors.relative_note`)."""
    folder = Path(config).resolve().parent if config is not None else Path.cwd()
    where = (
        f"in {config} is read from that file's folder"
        if config is not None
        else "(--set) is read from the working directory"
    )

    def rebased(value, key: str):
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            return value
        resolved = str(folder / value)
        RELATIVE[resolved] = f"{key}: {value} {where}"
        return resolved

    for section, key in INPUT_PATHS:
        if isinstance(data.get(section), dict) and key in data[section]:
            data[section][key] = rebased(data[section][key], f"{section}.{key}")
    components = (
        (data.get("reward") or {}).get("components") if isinstance(data.get("reward"), dict) else None
    )
    for i, c in enumerate(components if isinstance(components, list) else []):
        args = c.get("args") if isinstance(c, dict) else None
        for arg in REWARD_PATH_ARGS if isinstance(args, dict) else ():
            if arg in args:
                args[arg] = rebased(args[arg], f"reward.components.{i}.args.{arg}")
