"""`digenrl plan`'s tables survive a pipe and an 80-column terminal (issue 56): no cell cut mid-word
(`R / 2xH80 / 0 / T` was), every column kept, a piped row on one line."""

import io

from rich.console import Console

from digenrl.cli.tables import compact, show

ROWS = [  # what plan printed when it cut words: its placements, knobs and notes, with its 9 columns
    ["1", "colocated 16xH800", "m=2", "6.114", "83.74", "1%", "1.00", "1.00x", "FSDP x2"],
    [
        "3",
        "R 2xH800 / T 14xH800",
        "m=1 GAP TSP4 TAG async",
        "5.954",
        "85.99",
        "1%",
        "0.97",
        "0.97x",
        "FSDP x2",
    ],
    [
        "colocated whole groups",
        "colocated 16xH800",
        "m=2",
        "6.114",
        "83.74",
        "1%",
        "1.00",
        "1.00x",
        "FSDP x2",
    ],
    [
        "separate async",
        "R 5xH800 / T 11xH800",
        "m=1 no GAP async",
        "5.205",
        "98.36",
        "10%",
        "0.98",
        "0.85x",
        "mb 2",
    ],
]
HEADERS = ["#", "placement", "knobs", "samples/s", "s/iter", "bubble", "eff.", "vs col.", "notes"]


def table():
    t = compact()
    for h in HEADERS[:3]:
        t.add_column(h)
    for h in HEADERS[3:8]:
        t.add_column(h, justify="right", no_wrap=True, min_width=len(h))
    t.add_column("notes")
    for row in ROWS:
        t.add_row(*row)
    return t


def printed(**console) -> str:
    out = io.StringIO()
    show(Console(file=out, color_system=None, **console), table())
    return out.getvalue()


def test_an_80_column_terminal_gets_every_word_whole_within_80_columns():
    text = printed(width=80, force_terminal=True)
    assert max(len(line) for line in text.splitlines()) <= 80
    words = text.split()
    for cell in [*HEADERS, *(c for row in ROWS for c in row)]:
        for word in cell.split():
            assert word in words, word  # whole, as one token, in some line


def test_a_pipe_gets_one_line_a_row_at_the_tables_own_width():
    lines = printed(width=80).splitlines()
    for row in ROWS:
        (line,) = [x for x in lines if x.split()[:1] == row[0].split()[:1] and row[1] in x]
        for cell in row:
            assert cell in line
