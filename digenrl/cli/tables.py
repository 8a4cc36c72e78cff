"""Tables that survive a pipe and an 80-column terminal: no cell is cut mid-word, and piped output is
printed at the table's own width (nothing wrapped); ``--json`` is the form for scripts."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table


def compact(title: str | None = None) -> Table:
    """A table with light rules and one space between columns (the most columns in 80)."""
    return Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)


def whole_words(table: Table) -> Table:
    """Every column at least as wide as its longest word, so that rich wraps cells only at spaces."""
    for col in table.columns:
        texts = [str(col.header), *(str(c) for c in col.cells)]
        longest = max((len(w) for t in texts for w in t.split()), default=1)
        col.min_width = max(col.min_width or 0, longest)
        col.overflow = "fold"  # a word wider than the terminal itself: folded, never dropped
    return table


def fit(table: Table, console: Console, width: int) -> bool:
    """Fixed column widths that fit ``width``: each column its longest word, the room left shared in
    proportion to what each needs more for one line a cell (rich's own squeeze may crop the last
    column). Left as it is when it fits whole; False when not even the longest words fit."""
    texts = [[str(c.header), *(str(x) for x in c.cells)] for c in table.columns]
    widest = [max(len(line) for t in col for line in t.splitlines() or [""]) for col in texts]
    least = [max(c.min_width or 0, 1) for c in table.columns]
    overhead = console.measure(table, options=console.options.update_width(10_000)).maximum - sum(widest)
    room = width - overhead - sum(least)
    if room < 0:
        return False
    if sum(widest) + overhead <= width:
        return True
    need = [max(w - m, 0) for w, m in zip(widest, least)]
    for col, m, n in zip(table.columns, least, need):
        col.width = m + room * n // max(sum(need), 1)
    return True


def show(console: Console, table: Table) -> None:
    """Print ``table`` whole-worded: on a terminal within its width; to a pipe or a file at the table's
    natural width (one line a row)."""
    whole_words(table)
    if console.is_terminal and fit(table, console, console.width):
        console.print(table)
        return  # else (a terminal narrower than the longest words): lines longer than it, nothing cut
    width = console.width  # print clamps to it: widened for the table, then restored
    console.width = max(width, console.measure(table, options=console.options.update_width(10_000)).maximum)
    try:
        console.print(table, crop=False)
    finally:
        console.width = width


def say(console: Console, text: str) -> None:
    """A long note line: wrapped at words on a terminal, one line to a pipe."""
    console.print(text, soft_wrap=not console.is_terminal, highlight=False)
