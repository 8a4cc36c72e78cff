"""``--resume`` and an edited ``RUN/config.yaml``: a resumed run uses its checkpoint's config, so an
edit of the run directory's copy would be ignored (and then overwritten). Refused instead, with the
differing keys and how to apply them (``--set`` on resume, for the keys a resumed run may change)."""

from __future__ import annotations

from pathlib import Path

from digenrl.config.yamlfile import parse_yaml
from digenrl.errors import UserError

#: keys a resumed run may change with --set (dotted prefixes); anything else fixes what the checkpoint means
RESUMABLE = ("train.iterations", "train.lr", "output.")
#: what changing a key on resume does, where it is not obvious
NOTES = {"train.lr": "train.lr: the optimizer continues at the new rate from the checkpoint on"}


def flatten(data, prefix: str = "") -> dict:
    """A nested mapping as {dotted.key: value} (lists are values)."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


#: a key one side does not have
MISSING = object()


def differing_keys(edited: dict, original: dict) -> dict:
    """{key: (original value, edited value)} for every dotted key whose value differs (``MISSING``:
    the key is not on that side)."""
    a, b = flatten(original), flatten(edited)
    return {
        k: (a.get(k, MISSING), b.get(k, MISSING))
        for k in sorted(set(a) | set(b))
        if a.get(k, MISSING) != b.get(k, MISSING)
    }


def _yaml_value(v) -> str:
    import yaml

    return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def check_resume_config(run_dir: Path, checkpoint_config: Path, overrides: list[str]) -> None:
    """Refuse (one line) a resume whose ``RUN/config.yaml`` differs from ``checkpoint_config``, the
    config the resumed run uses, in a key that none of the command's ``overrides`` (``--set``) assigns."""

    edited_path = Path(run_dir) / "config.yaml"
    if not edited_path.is_file() or not Path(checkpoint_config).is_file():
        return
    edited = parse_yaml(edited_path, "--resume") or {}
    original = parse_yaml(checkpoint_config, "--resume") or {}
    if not isinstance(edited, dict):
        raise UserError(f"--resume: {edited_path}: top level must be a mapping of sections")
    assigned = [a.split("=", 1)[0].strip() for a in overrides]
    diff = {
        k: v
        for k, v in differing_keys(edited, original).items()
        if not any(k == a or k.startswith(a + ".") or a.startswith(k + ".") for a in assigned)
    }
    if not diff:
        return
    names = ", ".join(diff)
    settable = [k for k in diff if k.startswith(RESUMABLE)]
    fixed = [k for k in diff if k not in settable]
    how = []
    if settable:
        sets = " ".join(f"--set {k}={_yaml_value(diff[k][1])}" for k in settable if diff[k][1] is not MISSING)
        how.append(f"to apply {', '.join(settable)}: digenrl train --resume {run_dir} {sets}".rstrip())
        how += [NOTES[k] for k in settable if k in NOTES]
    if fixed:
        how.append(
            f"{', '.join(fixed)} cannot change on resume (the checkpoint was trained with them): "
            f"start a new run with -c {edited_path} --run-dir NEW"
        )
    raise UserError(
        f"--resume: {edited_path} differs from the config of the checkpoint it resumes "
        f"({checkpoint_config}) in {names}; a resumed run uses the checkpoint's config "
        f"and leaves {edited_path.name} unchanged; {'; '.join(how)}; or undo the edit"
    )
