"""Automatic feature labels' reading form (slmviz.features.labels): the top example's token in a word of context
either side, byte-level tokenizer marks cleaned, and the label joining that with the promoted tokens. The labels of
a real scan and an edited label winning: tests/test_workbench.py."""

from __future__ import annotations

import pytest

from slmviz.features.labels import AUTO, compose, in_context


@pytest.mark.parametrize(("context", "expected"), [
    ("the capital of the state of [[ Texas]] is Austin", "of «Texas» is"),  # a word either side
    ("all the mon[[ster]]s came", "mon«ster»s"),  # a piece of a word reads inside the word
    ("[[Hello]] world", "«Hello» world"),  # nothing before
    ("the end of it[[.]]", "it«.»"),
    ("line one\n[[ two]]\nthree", "one «two» three"),  # new lines read as spaces
    ("a verylongwordindeedandmore[[ x]]", "ndeedandmore «x»"),  # at most 12 characters of a word either side
    ("text without brackets", "text without brackets"),
])
def test_in_context_puts_the_token_in_a_word_of_context(context, expected):
    assert in_context(context) == expected


def test_byte_level_marks_are_cleaned_and_the_label_reads_fires_then_promotes():
    assert in_context("theĠ[[ĠParis]]ĊNews") == "the «Paris» News"
    assert compose(["of «Texas» is", "Dallas"], ["Austin", "Texas"]) == f"{AUTO}of «Texas» is / Dallas → Austin / Texas"
    assert compose([], ["Austin"]) == f"{AUTO}→ Austin"
