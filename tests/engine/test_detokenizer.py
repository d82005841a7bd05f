import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsserve.engine.detokenizer import IncrementalDetokenizer, StopChecker, check_stop_strings, check_token_stop
from dsserve.engine.sampling_params import SamplingParams
from dsserve.models.tokenizer import Tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.for_preset("tiny")


class ByteTok:
    """A synthetic byte-level tokenizer: each id is a fixed byte string; 0 is a special EOS."""

    eos_id = 0

    def __init__(self, pieces: list[bytes]):
        self.pieces = [b"<eos>"] + pieces

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0)).decode(
            "utf-8", errors="replace"
        )


def stream(tokenizer, prompt, ids, **kw):
    """Feed ids through a StopChecker; return (streamed deltas, checker)."""
    sc = StopChecker(tokenizer, prompt, SamplingParams(max_tokens=kw.pop("max_tokens", 1000), **kw))
    deltas = []
    for i in ids:
        deltas.append(sc.append(i))
        if sc.finished:
            break
    return deltas, sc


# ---------------------------------------------------------------- multi-byte characters
def test_emoji_split_across_tokens_streams_whole(tok):
    ids = tok.encode("Hi 😀 你好!", add_bos=False)
    assert any(FFFD in tok.decode([i]) for i in ids)  # the tokenizer really splits characters into bytes
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_bos=True))
    deltas = [detok.add_token(i) for i in ids]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == detok.text == "Hi 😀 你好!"
    assert "😀" in deltas and detok.output_token_ids == ids


PIECES = list("ab ,.\n") + ["é", "ß", "你", "好", "語", "😀", "🎉", "👍🏽", "Ω", "the", " 日本語"]
text_st = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


@settings(max_examples=80, deadline=None)
@given(prompt=text_st, out=text_st)
def test_deltas_concatenate_to_the_full_decode(tok, prompt, out):
    ids = tok.encode(out, add_bos=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_bos=True))
    deltas = [detok.add_token(i) for i in ids]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == out


def test_prompt_ending_mid_context_and_synthetic_bytes():
    e = "€".encode()  # 3 bytes
    t = ByteTok([e[:1], e[1:2], e[2:], b"x", "你".encode()])
    # prompt tail starts in the middle of a character; output completes characters byte by byte
    detok = IncrementalDetokenizer(t, [2, 3, 4, 1, 2, 3, 4, 4, 4, 4])
    deltas = [detok.add_token(i) for i in [1, 2, 3, 5, 4]]
    assert deltas == ["", "", "€", "你", "x"]


def test_special_tokens(tok):
    ids = tok.encode("ab", add_bos=False) + [tok.eos_id] + tok.encode("cd", add_bos=False)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(kept.add_token(i) for i in ids) == "ab<｜end▁of▁sentence｜>cd"
    assert "".join(skipped.add_token(i) for i in ids) == "abcd"


# ---------------------------------------------------------------- stop strings
@pytest.mark.parametrize(
    "text, stop, include, want",
    [
        ("Say STOP now. The stop word is here.", "P no", False, "Say STO"),
        ("Say STOP now. The stop word is here.", "P no", True, "Say STOP no"),
        ("The answer is 42.\n\nQuestion: what", "\n\nQue", False, "The answer is 42."),
        ("café naïve 日本語 🎉🎉 done", "日本", False, "café naïve "),
        ("café naïve 日本語 🎉🎉 done", "🎉 d", True, "café naïve 日本語 🎉🎉 d"),
    ],
)
def test_stop_string_straddling_tokens(tok, text, stop, include, want):
    ids = tok.encode(text, add_bos=False)
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds the stop string
    deltas, sc = stream(tok, tok.encode("Q:", add_bos=True), ids, stop=[stop], include_stop_str_in_output=include)
    assert (sc.text, sc.finish_reason, sc.stop_reason) == (want, "stop", stop)
    assert "".join(deltas) == want  # nothing streamed was later cut off
    assert all(FFFD not in d for d in deltas)
    assert sc.token_ids == ids[: len(sc.token_ids)]


@settings(max_examples=80, deadline=None)
@given(text=text_st, stop=text_st.filter(bool), include=st.booleans(), data=st.data())
def test_stop_string_property(tok, text, stop, include, data):
    """Whatever the text and stop string: cut at the first occurrence; the stream equals the final text."""
    if data.draw(st.booleans()) and len(text) > 2:  # often take the stop string from the text itself
        i = data.draw(st.integers(0, len(text) - 2))
        stop = text[i : data.draw(st.integers(i + 1, len(text)))]
    ids = tok.encode(text, add_bos=False)
    deltas, sc = stream(tok, tok.encode("x", add_bos=True), ids, stop=[stop], include_stop_str_in_output=include)
    at = text.find(stop)
    if at == -1:
        held = 0 if include else len(stop) - 1  # the tail kept back while the request runs
        assert sc.text == text and not sc.finished and "".join(deltas) == text[: max(0, len(text) - held)]
    else:
        assert sc.text == text[: at + (len(stop) if include else 0)] and sc.stop_reason == stop
        assert "".join(deltas) == sc.text


def test_synthetic_stop_and_holdback():
    t = ByteTok([b"ab", b"c</", b"s>d", b"ef", b"</"])
    deltas, sc = stream(t, [], [1, 2, 3, 4], stop=["</s>", "zz"])
    assert sc.text == "abc" and sc.stop_reason == "</s>" and sc.token_ids == [1, 2, 3]
    assert deltas == ["", "ab", "c"]  # "c</" waits behind the 3-char buffer; "</" is never streamed
    # a partial stop string at the end is released when the sequence ends by length
    deltas, sc = stream(t, [], [1, 5], stop=["</s>"], max_tokens=2)
    assert sc.finish_reason == "length" and "".join(deltas) == sc.text == "ab</"


def test_check_stop_strings_unit():
    assert check_stop_strings("hello world", 3, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("hello world", 3, ["wor"], True) == ("wor", 9)
    assert check_stop_strings("hello world", 3, ["rld"], True) == ("rld", -1)
    assert check_stop_strings("hello world", 2, ["hello"], False) is None  # not in the new text
    assert check_stop_strings("hello world", 5, ["zz", "o w", "wo"], False) == ("o w", 4)  # list order wins
    assert check_stop_strings("hello", 0, ["o"], False) is None


# ---------------------------------------------------------------- token stops, length, min_tokens
def test_eos_stop_token_and_length():
    t = ByteTok([b"a", b"b", b"c"])
    _, sc = stream(t, [], [1, 2, 0, 3])
    assert (sc.text, sc.finish_reason, sc.stop_reason, sc.token_ids) == ("ab", "stop", None, [1, 2, 0])
    _, sc = stream(t, [], [1, 0, 3], ignore_eos=True, max_tokens=3)
    assert (sc.text, sc.finish_reason, sc.token_ids) == ("ac", "length", [1, 0, 3])
    _, sc = stream(t, [], [1, 3, 2, 1], stop_token_ids=[3])
    assert (sc.text, sc.finish_reason, sc.stop_reason, sc.token_ids) == ("a", "stop", 3, [1, 3])
    _, sc = stream(t, [], [1, 3, 2], stop_token_ids=[3], include_stop_str_in_output=True)
    assert sc.text == "ac" and sc.stop_reason == 3
    _, sc = stream(t, [], [1, 2, 3], max_tokens=2)
    assert (sc.text, sc.finish_reason, sc.stop_reason) == ("ab", "length", None)
    _, sc = stream(t, [], [1, 2, 3], stop=["b"], max_tokens=2)  # stop string beats length on one token
    assert (sc.text, sc.finish_reason, sc.stop_reason) == ("a", "stop", "b")


def test_context_limit():
    p = SamplingParams(max_tokens=None)
    assert check_token_stop(p, [5, 6], eos_token_id=0, num_prompt_tokens=8, max_model_len=10) == ("length", None)
    assert check_token_stop(p, [5], eos_token_id=0, num_prompt_tokens=8, max_model_len=10) is None


def test_min_tokens_defers_stops():
    t = ByteTok([b"a", b"b", b"c"])
    _, sc = stream(t, [], [1, 0, 2, 0], min_tokens=3)
    assert (sc.text, sc.finish_reason, sc.token_ids) == ("ab", "stop", [1, 0, 2, 0])
    _, sc = stream(t, [], [2, 1, 2, 3], stop=["b"], min_tokens=2)  # the first "b" is within min_tokens
    assert (sc.text, sc.finish_reason, sc.stop_reason, sc.token_ids) == ("ba", "stop", "b", [2, 1, 2])
    with pytest.raises(RuntimeError):
        sc.append(1)
