"""Grammar-constrained sampling with xgrammar (the ``grammar`` extra), on any device.

``Grammars(tokenizer)`` compiles a request's ``SamplingParams.json_schema`` or ``structural_tag`` (xgrammar's
DeepSeek-V4 / V4.1 tool-call tags; cached per text; one it cannot compile is a ``GrammarError`` naming the
problem, which the front end turns into a 400) and makes one ``JsonGrammar`` per request, whose matcher
``accept(token)`` advances after the host reads the sampled token. A step's masks are two halves, as vLLM's and
SGLang's: ``GrammarMask.fill(rows)`` writes every constrained row's bitmask on the host from its matcher as it
stands, and the sampler's ``GrammarMask.apply(logits)`` sets -inf on every token the grammar does not allow next
(EOS only once the JSON is complete). The engine fills after launching the step's forward, so the fill runs while
the device computes; a step launched ahead of the host's read of the previous tokens (async scheduling) is
sampled only after that read (``EngineCore.step``). JSON is compact (no free whitespace), so a model cannot pad it
forever.
"""

from __future__ import annotations

import functools

import torch


class GrammarError(ValueError):
    """A ``json_schema`` that cannot be compiled, or xgrammar missing."""

    field = "response_format"


class JsonGrammar:
    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(token))


class GrammarMask:
    """The next-token masks of one step's constrained rows: ``bitmask`` [B, ceil(V / 32)] int32 on the host (a set
    bit allows a token) and ``rows``, the rows it constrains. A row whose grammar has terminated (it accepted EOS:
    the request continues only under ``ignore_eos``, or finished and its row of a step run ahead is dropped) is
    left unconstrained, as vLLM leaves it."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int]):
        self.bitmask, self.rows = bitmask, rows

    @classmethod
    def fill(cls, rows, vocab_size: int) -> GrammarMask | None:
        """From each row's ``grammar`` (None: unconstrained) as it stands; None when no row is constrained."""
        live = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        live = [i for i in live if not rows[i].grammar.matcher.is_terminated()]
        if not live:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
        for i in live:
            rows[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
        return cls(bitmask, live)

    def apply(self, logits: torch.Tensor) -> None:
        """-inf in ``logits`` [B, V] on every token a constrained row's grammar does not allow next, in place."""
        import xgrammar as xgr

        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, self.bitmask, indices=self.rows)
        else:  # one pinned upload, not waited for; every row (unconstrained ones allow all): no index upload
            xgr.apply_token_bitmask_inplace(logits, self.bitmask.pin_memory().to(logits.device, non_blocking=True))


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
        return JsonGrammar(self.compiled(kind, text))
