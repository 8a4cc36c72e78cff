"""What every config section shares: the error type, the section base class, the size limits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from digenrl.errors import UserError


class ConfigError(UserError):
    pass


def first_duplicate(names: list[str]) -> str | None:
    """The first name that appears more than once, or None."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return None


def on_off(value):
    """YAML reads a bare on / off as a boolean: back to the word."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class _Section(BaseModel):
    # inf / nan in a float field is refused at validation, naming the field
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


#: upper bounds that catch a typo (an extra zero or three) before a run that would never finish
MAX_STEPS = 1000


MAX_PIXELS = 8192


MAX_BATCH = 4096
