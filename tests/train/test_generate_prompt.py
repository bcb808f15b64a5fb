"""``moesaic generate --prompt`` with bytes that are not UTF-8 (issue 25 item 8): they reach
Python as lone surrogates, which failed to encode; the byte-level model now gets the bytes."""

from __future__ import annotations

from moesaic.train.generate import generate_text


def test_prompt_with_non_utf8_bytes(reference):
    prompt = b"caf\xe9 ".decode("utf-8", errors="surrogateescape")  # what argv holds
    out = generate_text(str(reference), prompt, max_new_tokens=4, temperature=0.0)
    assert out.startswith("caf\ufffd ")  # the byte went in; decoded lossily on the way out
