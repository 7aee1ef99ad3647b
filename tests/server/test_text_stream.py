"""Streamed text, piece by piece, on a byte-level tokenizer written out here: an incomplete UTF-8
character is held back until complete, the last (longest stop - 1) characters are held back
while they could still start a stop string, the final text flushes the rest, and nothing is
sent twice; and the default prompt size limit."""

from __future__ import annotations

from bole.server.api import default_prompt_bytes
from bole.server.responses import TextStream

PIECES = {1: b"ab", 2: b"\xc3", 3: b"\xa9c", 4: b"STO", 5: b"P", 6: b"de"}


class ByteTokenizer:
    """Each id is a byte string; decoding replaces an incomplete character with U+FFFD, as
    byte-level BPE tokenizers do."""

    def decode_batch(self, batch: list[list[int]]) -> list[str]:
        return [b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")
                for ids in batch]


def test_a_split_character_waits_for_its_last_byte():
    s = TextStream(ByteTokenizer(), ())
    assert [s.delta(ids, None) for ids in ([1], [1, 2], [1, 2, 3])] == ["ab", "", "éc"]
    assert s.delta([1, 2, 3, 6], "abécde") == "de"
    assert s.delta([1, 2, 3, 6], "abécde") == ""


def test_text_that_could_start_a_stop_string_waits():
    """Stops "STOP" and "x": three characters held back; the final text (cut before the stop
    string by the engine) sends what is left of it, and nothing of the stop string."""
    s = TextStream(ByteTokenizer(), ("STOP", "x"))
    assert s.delta([1], None) == ""
    assert s.delta([1, 6], None) == "a"
    assert s.delta([1, 6, 4], None) == "bde"
    assert s.delta([1, 6, 4, 5], "abde") == ""
    late = TextStream(ByteTokenizer(), ("STOP",))
    assert late.delta([1, 6], None) == "a"
    assert late.delta([1, 6], "abde") == "bde"


def test_default_prompt_limit_is_a_mebibyte_or_32_bytes_a_token():
    assert default_prompt_bytes(4096) == 1 << 20
    assert default_prompt_bytes(32768) == 1 << 20
    assert default_prompt_bytes(32769) == 32 * 32769
    assert default_prompt_bytes(262144) == 8 << 20
