"""``LLM``: the offline API, shaped like vLLM's, over the same ``EngineCore`` the server uses."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

from ..models.presets import DEFAULT_MODEL
from .args import EngineArgs
from .core import EngineCore, RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .warmup import warm_up

PromptType = str | list[int] | dict


class LLM:
    """``LLM(max_num_seqs=8)`` (the built-in trained model) or ``LLM(model="tiny")``: a preset name, a built-in
    checkpoint, a checkpoint directory or a Hugging Face id, plus engine options named like the CLI flags (vLLM's:
    ``data_parallel_size``, ``enable_expert_parallel``, ``dtype``, ``max_model_len``, ``seed``, ...). An option that
    does not exist, or a value this engine cannot honour, is an ``EngineArgsError`` naming it and what is allowed.
    With ``data_parallel_size`` > 1 the engine is a ``distributed.dp_client.DPClient`` (one process per rank)."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        args = EngineArgs.from_kwargs(model=model, **engine_options)
        if args.data_parallel_size > 1:  # one engine core per rank, each in its own process
            from ..distributed.dp_client import DPClient

            self.engine = DPClient(args)
        else:
            self.engine = EngineCore(args)
            if self.engine.args.warmup:
                warm_up(self.engine)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json defaults (``generation_config``), else SamplingParams()."""
        return SamplingParams(**self.engine.default_sampling)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or several, encoded by this family's chat
        format (``Tokenizer.apply_chat_template``), then ``generate``. ``chat_template_kwargs``: ``thinking`` /
        ``enable_thinking``, ``reasoning_effort``."""
        if lora_request is not None:
            raise RequestError("lora_request: dsserve serves no LoRA adapters")
        if chat_template is not None:
            raise RequestError("chat_template: this family's chat format is built in (server/chat.py); pass None")
        if continue_final_message:
            raise RequestError("continue_final_message=True is not supported: an assistant turn is always closed")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise RequestError(
                f"chat_template_content_format must be auto, string or openai, got {chat_template_content_format!r}"
            )
        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if one else list(messages)
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            try:
                ids = tok.apply_chat_template(
                    list(conv), tools=tools, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
                )
            except ValueError as e:  # ChatFormatError: names the offending message
                raise RequestError(str(e)) from None
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise RequestError(f"{len(priority)} priorities for {len(prompts)} prompts")
        # Validate every prompt before any enters the engine: a bad one must not leave the others half-run.
        groups = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise RequestError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            extra = {k: prompt.get(k) for k in ("cache_salt", "session_id")} if isinstance(prompt, dict) else {}
            base = str(next(self._ids))
            subs = [
                (f"{base}-{k}" if sp.n > 1 else base, replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k))
                for k in range(sp.n)
            ]
            groups.append((base, self._as_list([prompt])[0], subs, 0 if priority is None else priority[i], extra))
        added = []
        try:
            for base, prompt, subs, prio, extra in groups:
                for rid, sp in subs:
                    self.engine.add_request(rid, prompt, sp, prio, **extra)
                    added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        with _progress(len(added), use_tqdm) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        advance()
        return [self._merge(base, [final[rid] for rid, _ in subs]) for base, _, subs, _, _ in groups]

    @staticmethod
    def _as_list(prompts) -> list:
        """Prompt text or token ids of each prompt; a dict may carry cache_salt and session_id."""
        out = []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            if not isinstance(p, (str, list)):
                raise RequestError(f"a prompt is a str, a list of token ids or a dict, got {type(p).__name__}")
            out.append(p)
        return out

    @staticmethod
    def _merge(base: str, outs: list[RequestOutput]) -> RequestOutput:
        if len(outs) == 1:
            return outs[0]
        comps = []
        for k, o in enumerate(outs):
            c = o.outputs[0]
            c.index = k
            comps.append(c)
        first = outs[0]
        return RequestOutput(
            base,
            first.prompt,
            first.prompt_token_ids,
            comps,
            True,
            first.metrics,
            num_cached_tokens=first.num_cached_tokens,
        )


class _progress:
    """A rich progress bar over finished requests (silent when disabled or for a single request)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and total > 1
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
        )
        self.bar.start()
        task = self.bar.add_task("generating", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
