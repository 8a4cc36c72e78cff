"""`config validate` refuses everything `train` refuses before its first iteration, with the same line
(issue 56). The list is the bad-input table's `train` cases (tests/test_bad_input.py: one per UserError
site reached at train start -- config schema, adapters, model and LoRA targets, prompt files and
images, rewards' names, args and files, algorithm combinations, the host), each run through both."""

import pytest

from tests.test_bad_input import CASES, cli, make_inputs, write_big_prompt

#: train cases about the run directory, a resume or the command line itself, not the config
NOT_CONFIG = ("--resume", "-q", "--frobnicate")
#: train refuses these only once Ray runs (in the workers); their train side is in test_bad_input's slow tests
IN_WORKERS = {
    "LoRA targets matching no module",
    "an ocr prompt quoting no text",
    "a geneval prompt without GenEval metadata",
}
TRAIN_CASES = [n for n, (argv, _) in CASES.items() if argv[0] == "train" and not set(NOT_CONFIG) & set(argv)]


def _run(argv, t, monkeypatch, capsys):
    return cli(monkeypatch, capsys, [a.replace("{t}", str(t)) for a in argv])


def test_the_parity_list_covers_the_refusals_that_used_to_slip_through():
    """The refusals `validate` missed before issue 56 are in the list."""
    needles = " ".join(CASES[n][1] for n in TRAIN_CASES)
    for line in ("unknown reward", "reward 'hpsv2': checkpoint file", "a JSON array, not an object"):
        assert line in needles


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_validate_refuses_what_train_refuses_with_the_same_line(case, tmp_path, monkeypatch, capsys):
    argv, needle = CASES[case]
    t = make_inputs(tmp_path)
    if "big.txt" in " ".join(argv):
        write_big_prompt(t)
    code, validated = _run(["config", "validate", *argv[1:]], t, monkeypatch, capsys)
    assert code == 2 and needle.replace("{t}", str(t)) in validated, validated
    assert validated.count("\n") == 1
    if case in IN_WORKERS:
        return
    code, trained = _run([*argv, "--run-dir", str(t / "run")], t, monkeypatch, capsys)
    assert code == 2 and trained == validated  # the same line, word for word
    assert not (t / "run").exists()
