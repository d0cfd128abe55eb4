"""StopStrings: stops found across chunks, held-back partial matches, earliest stop wins."""
from __future__ import annotations

import random

import pytest

from gateway.stop_strings import StopStrings


def feed_all(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    """Feeds chunks until stopped; returns (all emitted text incl. flush, stopped, per-chunk text)."""
    checker = StopStrings(stops)
    emitted = []
    for chunk in chunks:
        check = checker.feed(chunk)
        emitted.append(check.text)
        if check.is_stopped:
            return "".join(emitted), True, emitted
    return "".join(emitted) + checker.flush(), False, emitted


def test_no_stop_strings_passes_through():
    checker = StopStrings([])
    check = checker.feed("Hello world")
    assert check.text == "Hello world"
    assert not check.is_stopped
    assert checker.flush() == ""


def test_empty_stop_string_is_ignored():
    check = StopStrings([""]).feed("abc")
    assert check.text == "abc"
    assert not check.is_stopped


def test_stop_in_one_chunk():
    check = StopStrings(["END"]).feed("Hello END world")
    assert check.text == "Hello "
    assert check.is_stopped


def test_stop_at_start():
    check = StopStrings(["END"]).feed("END")
    assert check.text == ""
    assert check.is_stopped


def test_stop_across_chunk_boundaries():
    text, stopped, per_chunk = feed_all(["END"], ["Hel", "lo E", "N", "D more"])
    assert stopped
    assert text == "Hello "
    assert per_chunk == ["Hel", "lo ", "", ""]


def test_stop_across_many_single_char_chunks():
    text, stopped, _ = feed_all(["</answer>"], list("42</answer> trailing"))
    assert stopped
    assert text == "42"


def test_partial_match_held_then_released():
    checker = StopStrings(["END"])
    assert checker.feed("ab E").text == "ab "
    assert checker.feed("N").text == ""  # "EN" might still become "END"
    check = checker.feed("x")
    assert check.text == "ENx"
    assert not check.is_stopped
    assert checker.flush() == ""


def test_partial_match_released_by_mismatch_in_same_chunk():
    checker = StopStrings(["END"])
    assert checker.feed("xE").text == "x"
    assert checker.feed("Ey").text == "EEy"


def test_self_overlapping_stop():
    checker = StopStrings(["aab"])
    assert checker.feed("aaa").text == "a"  # "aa" could begin "aab"
    check = checker.feed("b")
    assert check.is_stopped
    assert check.text == ""  # "aaab" stops after the first "a", already emitted


def test_longest_partial_match_held():
    checker = StopStrings(["abcd", "cx"])
    check = checker.feed("zabc")
    assert check.text == "z"  # "abc" (for "abcd") covers "c" (for "cx")
    assert checker.feed("q").text == "abcq"


@pytest.mark.parametrize("stops", [["STOP", "END"], ["END", "STOP"]])
def test_earliest_stop_wins(stops):
    check = StopStrings(stops).feed("x END y STOP z")
    assert check.is_stopped
    assert check.text == "x "


def test_earliest_stop_wins_across_chunks():
    text, stopped, _ = feed_all(["STOP", "END"], ["a ST", "b EN", "D c STOP"])
    assert stopped
    assert text == "a STb "


def test_flush_returns_held_text():
    checker = StopStrings(["END"])
    assert checker.feed("abc E").text == "abc "
    assert checker.flush() == "E"
    assert checker.flush() == ""


def test_text_after_stop_is_dropped():
    checker = StopStrings(["END"])
    checker.feed("aEN")
    check = checker.feed("D trailing E")
    assert check.is_stopped
    assert check.text == ""
    assert checker.flush() == ""


def test_output_independent_of_chunking():
    # no stop is a substring of another, so the first stop to start is also the first to end
    stops = ["</s>", "STOP", "ab\nab"]
    rng = random.Random(7)
    alphabet = ["a", "b", "\n", "<", "/", "s", ">", "S", "T", "O", "P", " ", "x"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[: min(hits)] if hits else text
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got, stopped, _ = feed_all(stops, chunks)
        assert stopped == bool(hits), (text, chunks)
        assert got == expected, (text, chunks)
