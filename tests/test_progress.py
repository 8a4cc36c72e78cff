"""The progress hook drivers call for the stages the user should see."""

from digenrl.progress import listening, progress


def test_stages_reach_the_listener_only_while_listening():
    seen = []
    progress("before...")  # no listener: nothing happens, nothing fails
    with listening(seen.append):
        progress("starting workers...")
        progress("waiting for the first weights...")
    progress("after...")
    assert seen == ["starting workers...", "waiting for the first weights..."]
