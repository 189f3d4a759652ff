"""``split_first_clause`` never leaves a one-word tail: when the longest head that
fits would leave less than ``min_s`` of the sentence, it cuts earlier."""

from __future__ import annotations

import pytest

from wyoming_cosyvoice3.engine.text.pieces import split_first_clause


def _words_s(text: str) -> float:
    """0.4 s per word: two words reach the 0.8 s minimum, six the 2.5 s maximum."""
    return 0.4 * len(text.split())


@pytest.mark.parametrize(("text", "head", "rest"), [
    # seven words without a comma: the six-word head would leave "seven." alone
    ("one two three four five six seven.", "one two three four five", "six seven."),
    # the same in a longer text: the sentence's rest, not the text's, must keep two words
    ("one two three four five six seven. Eight nine ten eleven.",
     "one two three four five", "six seven. Eight nine ten eleven."),
    # a clause mark that would leave one word is not taken either; a blank before it is
    ("one two three four five six, seven.", "one two three four five", "six, seven."),
])
def test_a_cut_keeps_two_words_after_it(text: str, head: str, rest: str) -> None:
    got_head, got_rest = split_first_clause(text, 2.5, 0.8, _words_s)
    assert (got_head, got_rest) == (head, rest)
    sentence_rest = got_rest.split(".")[0]
    assert _words_s(sentence_rest) >= 0.8


def test_an_eight_word_sentence_takes_the_longest_head() -> None:
    # the rest keeps two words either way: the longest fitting head wins
    assert split_first_clause("one two three four five six seven eight.", 2.5, 0.8,
                              _words_s) == ("one two three four five six", "seven eight.")
