"""bench.task_sources: which sampled continuations become source texts, on known answers."""

from __future__ import annotations

from bench.task_sources import source_text


def test_a_german_sentence_after_a_headline_is_kept_alone():
    raw = "<strong>Neue Regeln</strong>\n\nDie Regierung hat am Montag neue Regeln für den Verkehr in der Stadt beschlossen."
    assert source_text(raw, "translation") == \
        "Die Regierung hat am Montag neue Regeln für den Verkehr in der Stadt beschlossen."


def test_a_sentence_cut_before_its_end_or_too_short_is_dropped():
    assert source_text("Die Regierung hat am Montag neue Regeln für", "translation") is None
    assert source_text("Neue Regeln.", "translation") is None  # under six words
    assert source_text("1234 5678 9012 3456 7890 1234 5678.", "translation") is None  # digits, not text


def test_a_news_story_is_cut_at_its_last_sentence_end():
    body = " ".join(f"Sentence number {i} tells the reader one more fact about the town council." for i in range(20))
    text = source_text(body + " And then the meeting was", "summarization")
    assert text == body
    assert source_text("Only a few words. Then", "summarization") is None  # under 150 words


def test_a_news_story_ending_in_a_quotation_keeps_its_closing_quote():
    body = " ".join(f"Sentence number {i} tells the reader one more fact about the town council." for i in range(20))
    quoted = body + ' The mayor said: "We will build it."'
    assert source_text(quoted + " Then the", "summarization") == quoted
