"""OpenAI response shapes: completion and chat bodies, stream chunks, logprobs, usage, errors."""

from __future__ import annotations

import time
import uuid

from ..engine.outputs import CompletionOutput, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(outs: list[RequestOutput], n: int) -> dict:
    """Choices come prompt-major, ``n`` per prompt: count each prompt once and every choice's tokens."""
    firsts = outs[::n]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """One choice's usage so far (``stream_options.continuous_usage_stats``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def context_length_message(max_model_len: int, prompt_tokens: int, max_tokens: int) -> str:
    """vLLM's wording (clients match "maximum context length" to shorten and retry)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {max_tokens} "
        f"output tokens and your prompt contains at least {prompt_tokens} input tokens, for a total of at least "
        f"{prompt_tokens + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
        f"requested output tokens. (max_model_len={max_model_len}, input_tokens={prompt_tokens})"
    )


def completion_logprobs(c: CompletionOutput, start: int, text_offset: int, top_n: int) -> dict | None:
    """Legacy completions logprobs for tokens [start:] of the choice."""
    if c.logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen = entry[tid]
        tokens.append(chosen.decoded_token)
        lps.append(chosen.logprob)
        tops.append({e.decoded_token: e.logprob for e in entry.values() if e.rank is not None and e.rank <= top_n})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        chosen = entry[tid]
        top = sorted((e for e in entry.values()), key=lambda e: e.rank or 10**9)[:top_n]
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {"token": e.decoded_token, "logprob": e.logprob, "bytes": list((e.decoded_token or "").encode())}
                    for e in top
                ],
            }
        )
    return {"content": content}


def completion_body(rid: str, model: str, outs: list[RequestOutput], logprobs: int | None, n: int) -> dict:
    choices = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        choices.append(
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": completion_logprobs(c, 0, 0, logprobs) if logprobs is not None else None,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outs, n),
    }


def chat_body(rid: str, model: str, outs: list[RequestOutput], top_logprobs: int | None, n: int) -> dict:
    choices = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": chat_logprobs(c, 0, top_logprobs or 0) if top_logprobs is not None else None,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outs, n),
    }


def stream_chunk(
    rid: str,
    model: str,
    chat: bool,
    index: int,
    delta_text: str | None,
    finish: str | None,
    logprobs: dict | None = None,
    role: bool = False,
) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": delta_text} if delta_text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": delta_text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
