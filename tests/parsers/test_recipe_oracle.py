"""The output parser against DeepSeek's own stream parser (deepseek-recipe 0.2.0, a test extra) on well-formed
outputs, where spec tool_calling.md 6.8 says the two must agree (they differ on malformed and truncated output)."""

import json

import pytest
from test_output_parser import CASES

from dsserve.parsers import parse_output

dr = pytest.importorskip("deepseek_recipe")
AGREE = [  # well-formed outputs; the others exercise the recovery and truncation rules recipe 0.2.0 lacks
    "plain",
    "think",
    "think-leading-nl",
    "v41-call-thinking",
    "v4-content-then-call",
    "v4-parallel",
    "no-params",
    "opener-ends-reasoning",
    "string-raw",
    "json-values",
    "holdback-flush",
    "unicode",
    "think-late-close",
    "think-never-closed",
    "nonthink-stray-close",
    "v32-opener-from-v4",
    "v41-tags-in-v4-dialect",
    "duplicate-last-wins",
    "whitespace-after-block",
    "holdback-flush-think-prefix",
    "bare-invoke-declared",
    "eos-after-block",
    "reasoning-with-lt",
]
# The other cases differ exactly where spec 6.8 says recipe 0.2.0 does: it drops text after the first block and
# later blocks, swallows content after a stray DSML tag, keeps a repeated <think>, fails on invalid JSON and cut
# values, commits bare invokes of undeclared tools, and leaves an EOS spelling in the text.


def recipe(text: str, dialect: str, thinking: bool, names):
    model = "DeepSeek-V4.1-Flash" if dialect == "v4.1" else "DeepSeek-V4-Pro"
    tools = [
        {"type": "function", "function": {"name": n, "description": "", "parameters": {"type": "object"}}}
        for n in names
    ]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "q"}],
        "tools": tools,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(conv, "id", model), conv.parsing_options)
    chunks = proc.push(dr.InferenceChunk.ready())
    for ch in text:  # one character at a time, as its own tests split
        chunks += proc.push(dr.InferenceChunk.text(ch, 1))
    chunks += proc.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + proc.finish()
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        for choice in json.loads(c.to_json()).get("choices", []):
            d = choice.get("delta", {})
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for t in d.get("tool_calls") or []:
                call = calls.setdefault(t["index"], {"name": "", "arguments": ""})
                call["name"] += t.get("function", {}).get("name") or ""
                call["arguments"] += t.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content, reasoning, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("name", AGREE)
def test_agrees_with_deepseek_recipe(name):
    _, kw, text, *_ = next(c for c in CASES if c[0] == name)
    dialect, thinking = kw.get("dialect", "v4.1"), kw.get("thinking", False)
    names = ["get_weather", "now", "f", "g"]  # recipe's chat API refuses namespaced names
    out = parse_output(text, dialect=dialect, thinking=thinking, tools=names)
    ours = (
        out.content,
        out.reasoning_content or "",
        [(c.name, c.arguments) for c in out.tool_calls],
        out.finish_reason,
    )
    assert ours == recipe(text, dialect, thinking, names)
