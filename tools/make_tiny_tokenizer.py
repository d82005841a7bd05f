#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer shipped for the tiny presets (``dsserve/data/tiny/``).

Where the text comes from
-------------------------
Only from this machine's Python standard library, so no download is needed: every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``, walked in sorted order, skipping ``site-packages``, the test suites
(``test``/``tests``), ``idlelib``, ``lib2to3``, ``turtledemo`` and ``config-*``. From each file we take
(1) its docstrings (module, class and function, via ``ast``) -- English prose -- and (2) its source code, so
the vocabulary covers both prose and Python. A file that does not parse contributes its source only.

What comes out
--------------
``tokenizer.json``: byte-level BPE (any UTF-8 text round-trips through the 256 byte symbols), 8192 ids:
0 ``<｜begin▁of▁sentence｜>``, 1 ``<｜end▁of▁sentence｜>``, 2 ``<｜▁pad▁｜>`` (trainer specials, so they come
first), 3..8189 the learned vocabulary, 8190 ``<｜image｜>`` and 8191 ``<｜noise｜>`` (added after training, so
they land at the end). The pre-tokenizer follows the DeepSeek-V3/V4 layout (digits in runs of at most 3, CJK
runs isolated, then a GPT-style word split, then ByteLevel). ``tokenizer_config.json`` names bos/eos/pad.

Deterministic: the corpus order is fixed and the ``tokenizers`` BPE trainer breaks count ties by pair order.
The exact merges depend on the stdlib version (this file was produced with CPython 3.11); the shipped JSON is
the artifact, this script documents and reproduces it.

    python tools/make_tiny_tokenizer.py [--out dsserve/data/tiny]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE, NOISE = "<｜image｜>", "<｜noise｜>"
TRAILING = [IMAGE, NOISE]  # ids VOCAB_SIZE-2, VOCAB_SIZE-1
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
WORD_SPLIT = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def stdlib_files(root: str) -> list[str]:
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-"))
        out += [os.path.join(here, f) for f in sorted(files) if f.endswith(".py")]
    return out


def docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node))]


def corpus(root: str):
    """Yield one training text per docstring and per source file, in a fixed order."""
    for path in stdlib_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            source = f.read()
        yield from docstrings(source)
        yield source


def build(root: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.Split(Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated"),
            pre_tokenizers.Split(Regex(WORD_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TRAILING),
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(root), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE - len(TRAILING):
        sys.exit(f"trainer produced {tok.get_vocab_size()} ids, wanted {VOCAB_SIZE - len(TRAILING)}")
    tok.add_special_tokens(TRAILING)
    want = {BOS: 0, EOS: 1, PAD: 2, IMAGE: VOCAB_SIZE - 2, NOISE: VOCAB_SIZE - 1}
    got = {t: tok.token_to_id(t) for t in want}
    if got != want or tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        sys.exit(f"special ids came out {got}, size {tok.get_vocab_size(with_added_tokens=True)}")
    return tok


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "..", "dsserve", "data", "tiny"))
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="Python stdlib directory")
    a = ap.parse_args()
    tok = build(a.stdlib)
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "image_token": IMAGE,
        "noise_token": NOISE,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(
        f"wrote {a.out}: {tok.get_vocab_size(with_added_tokens=True)} ids, "
        f"{os.path.getsize(os.path.join(a.out, 'tokenizer.json'))} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
