"""Text at the serving edges: incremental detokenisation, stop strings held back across pieces, prompt encoding."""

import pytest

from ttftc.text import IncrementalDecoder, NoTokenizerError, OutputText, PromptCodec, StopStrings


class ByteTokenizer:
    """Token i is byte i; a decode that ends inside a UTF-8 character ends in U+FFFD, as real tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_across_tokens_is_emitted_once_whole():
    decoder = IncrementalDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in "aé€b".encode()]
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    assert "".join(pieces) == "aé€b"


def test_without_a_tokenizer_tokens_read_as_ids():
    decoder = IncrementalDecoder(None)
    assert [decoder.push(t) for t in (5, 17)] == ["<5>", "<17>"]


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_first_stop():
    stops = StopStrings(["END", "\n\n"])
    assert stops.feed("hello E") == "hello "  # "E" may start "END": held back
    assert stops.feed("x") == "Ex"  # it did not
    assert stops.feed("yz\n") == "yz"
    assert stops.feed("\nmore") == "" and stops.stopped
    assert stops.feed("later") == "" and stops.flush() == ""
    tail = StopStrings(["END"])
    assert tail.feed("abcEN") == "abc" and tail.flush() == "EN"  # the output ended: what was held is released


def test_output_text_applies_stops_to_the_decoded_stream():
    out = OutputText(PromptCodec(ByteTokenizer()), stop=["ü"])
    for b in "xyüz".encode():
        out.push(b)
    assert out.stopped and out.text == "xy"


def test_prompt_codec_refuses_text_without_a_tokenizer_and_checks_ids():
    codec = PromptCodec(None)
    assert codec.encode([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(NoTokenizerError, match="no tokenizer.*token ids"):
        codec.encode("hello")
    with pytest.raises(NoTokenizerError, match="no tokenizer"):
        codec.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="string or a list of integer"):
        codec.encode([1, 2.5])
    with pytest.raises(ValueError, match="string or a list of integer"):
        codec.encode([True, 2])
