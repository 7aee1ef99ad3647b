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

    def decode(self, ids: list[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


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


class LeadingSpaceTokenizer:
    """A SentencePiece-like tokenizer: each id is a word with a leading space, and a decode
    drops the space before its first word; it counts the ids it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return "".join(f" w{i}" for i in ids)[1:]


def test_streamed_deltas_add_up_to_the_whole_decode_and_decode_each_token_a_few_times():
    """Token by token, the deltas joined equal one decode of all the tokens (a decode's first
    token treated apart, as SentencePiece does, and bytes split across tokens on the bundled
    byte-level tokenizer), and a stream of n tokens decodes about 2n tokens, not n^2 / 2."""
    from tokenizers import Tokenizer

    from bole.assets import BUNDLED_MODEL
    spaced = LeadingSpaceTokenizer()
    ids = list(range(300))
    s = TextStream(spaced, ())
    assert "".join(s.delta(ids[:n], None) for n in range(1, 301)) == \
        LeadingSpaceTokenizer().decode(ids)
    assert spaced.decoded <= 3 * len(ids)
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    text = "Café 🙂 naïve — 日本語 text, split\tacross\nlines ✓ " * 4
    ids = tok.encode(text).ids
    s = TextStream(tok, ())
    assert "".join(s.delta(ids[:n], None) for n in range(1, len(ids) + 1)) == tok.decode(ids)
