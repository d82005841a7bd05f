"""Grammar-constrained sampling with xgrammar (the ``grammar`` extra), on any device.

``Grammars(tokenizer)`` compiles a request's ``SamplingParams.json_schema`` or ``structural_tag`` (xgrammar's
DeepSeek-V4 / V4.1 tool-call tags; cached per text; one it cannot compile is a ``GrammarError`` naming the
problem, which the front end turns into a 400) and makes one
``JsonGrammar`` per request: ``mask(logits, row)`` sets -inf on every token the schema does not allow next (EOS
only once the JSON is complete), ``accept(token)`` advances it after the host reads the sampled token. A
constrained request never runs a step ahead of that read (``EngineCore._may_run_ahead``). JSON is compact (no
free whitespace), so a model cannot pad it forever.
"""

from __future__ import annotations

import functools

import torch


class GrammarError(ValueError):
    """A ``json_schema`` that cannot be compiled, or xgrammar missing."""

    field = "response_format"


class JsonGrammar:
    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        line = logits[row : row + 1]
        if line.device.type == "cpu":
            self._xgr.apply_token_bitmask_inplace(line, self.bitmask)
        else:  # the kernel wants the mask on the logits' device
            self._xgr.apply_token_bitmask_inplace(line, self.bitmask.to(line.device, non_blocking=True))
        logits[row : row + 1] = line

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(token))


class Grammars:
    """Compiles and caches schemas for one tokenizer (a byte-level BPE vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def _compiler(self):
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise GrammarError(
                "structured output (response_format json_object / json_schema) needs xgrammar: "
                "pip install 'dsserve[grammar]'"
            ) from e
        pieces = [""] * self.vocab_size
        for piece, i in self.tokenizer.tok.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                pieces[i] = piece
        stops = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size, stop_token_ids=stops)
        return xgr.GrammarCompiler(info)

    @functools.lru_cache(maxsize=64)
    def compiled(self, kind: str, text: str):
        """``kind`` "json_schema" (compact JSON) or "structural_tag" (xgrammar's, as JSON: DSML tool calls)."""
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            return self._compiler.compile_structural_tag(text)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar reports a bad schema as RuntimeError / ValueError with its reason
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            what = "response_format: the JSON schema" if kind == "json_schema" else "tools: the parameter schemas"
            err = GrammarError(f"{what} cannot be compiled: {reason}")
            err.field = "response_format" if kind == "json_schema" else "tools"
            raise err from None

    def grammar(self, kind: str, text: str) -> JsonGrammar:
        return JsonGrammar(self.compiled(kind, text), self.vocab_size)
