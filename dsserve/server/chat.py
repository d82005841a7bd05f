"""OpenAI chat messages -> DeepSeek-V4 (default) / V4.1 prompt text and ids.

Sources: the V4 release ``encoding/encoding_dsv4.py`` (as vendored in sglang ``encoding_dsv4.py``; matches its
golden tests 1-2), the V4.1 release ``encoding/encoding.py`` (vendored copies; sglang ``encoding_dsv41.py``),
and vLLM ``tokenizers/deepseek_v4.py`` / ``deepseek_v41.py`` for the request-level glue (tools, generation).
BOS, then per message: system -> its text (V4.1: ``<｜System｜>`` + text); user/developer -> ``<｜User｜>`` + text;
assistant -> [reasoning ``</think>``] + content [+ DSML tool calls] + EOS. A user turn followed by an assistant
turn or generation gets ``<｜Assistant｜>`` + ``<think>`` (thinking) or ``</think>`` (chat). Thinking mode: turns
before the last user message open ``</think>`` and lose reasoning (developer turns there are dropped), later
ones keep ``reasoning</think>``; with tools nothing is dropped and every turn opens ``<think>``. ``tool``
messages merge with adjacent user messages into one user turn of ``<tool_result>..</tool_result>`` blocks
(blank-line joined, sorted by call order). Request tools go on a leading system/developer message, else on a
new empty leading system message: ``{system}\n\n## Tools ...`` (vLLM). Effort: V4 renders only ``max`` (a
preamble); V4.1 always renders ``Reasoning Effort: N`` first in thinking mode (low/high/max = 50/75/100).

Deviations: ``add_generation_prompt=False`` omits the final header; with True a header also follows a trailing
assistant/system message (vLLM V4.1; the references add none). List content joins text parts with a blank line
(V4.1). V4.1 keeps V4's developer role (sglang/vLLM). No images, ``response_format``, ``latest_reminder``,
tasks. Content is not escaped: a special-token string in it becomes that token (as in the references).
"""

import functools
import json

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
THINK, END_THINK, DSML = "<think>", "</think>", "｜DSML｜"
_json = functools.partial(json.dumps, ensure_ascii=False)
ROLES = ("system", "developer", "user", "assistant", "tool")
TAGS = {"v4": ("tool_calls", "invoke", "parameter"), "v41": (" calls", " invoke", " parameter")}
EFFORT_V4 = (None, "low", "medium", "high", "max")
EFFORT_V41 = {"low": 50, "high": 75, "max": 100}  # the official V4.1 encoding.py (vLLM had 25/50/75/100)
EFFORT_MAX_V4 = (  # the V4 reference's REASONING_EFFORT_MAX
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking "
    "and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic "
    "against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire "
    "deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis "
    "to ensure absolutely no assumption is left unchecked.\n\n"
)
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}{b}>" block like the following:

<{d}{b}>
<{d}{i} name="$TOOL_NAME">
<{d}{p} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}{p}>
...
</{d}{i}>
<{d}{i} name="$TOOL_NAME2">
...
</{d}{i}>
</{d}{b}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {ts}), you MUST output your complete reasoning inside {ts}...{te} BEFORE any tool calls or final response.

Otherwise, output directly after {te} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatFormatError(ValueError):
    """A chat request that cannot be encoded; the message names the offending field."""


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}: must be a string or a list of text parts, not {type(content).__name__}")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ChatFormatError(
                f"{where}[{j}]: unsupported content part (type {kind!r}); only "
                f"{{'type': 'text', 'text': <string>}} parts are accepted"
            )
    return "\n\n".join(part["text"] for part in content)


def _tool_call(tc, where: str) -> tuple[str, str, dict]:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where}: needs function.name (OpenAI tool call shape)")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # as the V4 reference: unparsable JSON travels as one string argument
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"arguments": args}
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}: function.arguments must be a JSON object")
    return str(tc.get("id") or ""), fn["name"], args


def _normalize(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out, order = [], {}
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ChatFormatError(f"{where}: unknown role {role!r}; expected one of {list(ROLES)}")
        calls = m.get("tool_calls") or [] if role == "assistant" else []
        rc = m.get("reasoning_content", m.get("reasoning"))
        if not isinstance(calls, list):
            raise ChatFormatError(f"{where}.tool_calls: must be a list")
        calls = [_tool_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(calls)]
        if m.get("content") is None and not (role == "assistant" and (calls or rc is not None)):
            raise ChatFormatError(f"{where} ({role}): missing content")
        text = "" if m.get("content") is None else _text(m["content"], f"{where}.content")
        msg = {"role": role, "content": text, "calls": calls}
        if role == "assistant":
            msg["reasoning"] = "" if rc is None else _text(rc, f"{where}.reasoning_content")
            order = {cid: k for k, (cid, _, _) in enumerate(calls) if cid} if calls else order
        elif role in ("user", "tool"):  # runs of user/tool turns become one user turn
            kind = "tool" if role == "tool" else "text"
            msg.update(role="user", blocks=[(kind, text, str(m.get("tool_call_id") or ""))])
            if out and "blocks" in out[-1]:
                out[-1]["blocks"] += msg["blocks"]
                msg = out.pop()
            tools = iter(sorted((b for b in msg["blocks"] if b[0] == "tool"), key=lambda b: order.get(b[2], 0)))
            msg["blocks"] = [next(tools) if b[0] == "tool" else b for b in msg["blocks"]]
        out.append(msg)
    return out


def encode_chat(
    messages: list[dict],
    *,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    tools: list | None = None,
    reasoning_effort: str | int | None = None,
    version: str = "v4",
) -> str:
    """The prompt text for OpenAI-style ``messages`` (starts with BOS). ``version``: ``"v4"`` or ``"v41"``;
    ``reasoning_effort``: V4 None/low/medium/high/max, V4.1 None/low/high/max or an int in [1, 100]."""
    if version not in TAGS:
        raise ChatFormatError(f"version must be one of {list(TAGS)}, not {version!r}")
    v41, eff = version == "v41", reasoning_effort
    if not (
        (type(eff) is int and 1 <= eff <= 100 or eff is None or isinstance(eff, str) and eff in EFFORT_V41)
        if v41
        else eff is None or isinstance(eff, str) and eff in EFFORT_V4
    ):
        raise ChatFormatError(f"reasoning_effort {eff!r} is not valid for {version}")
    msgs = _normalize(messages)
    if tools:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
        ):
            raise ChatFormatError("tools must be a list of {'type': 'function', 'function': {...}} objects")
        if msgs[0]["role"] not in ("system", "developer"):
            msgs.insert(0, {"role": "system", "content": "", "calls": []})
        msgs[0]["tools"] = [t["function"] for t in tools]
    drop, (blk, inv, par) = not tools, TAGS[version]

    def last_user(ms):
        return max(
            (
                k
                for k, m in enumerate(ms)
                if m["role"] in ("user", "developer") or (v41 and m["role"] == "system" and k > 0)
            ),
            default=-1,
        )

    if thinking and drop:  # reference _drop_thinking_messages
        lu = last_user(msgs)
        msgs = [
            dict(m, reasoning="") if m["role"] == "assistant" and k < lu else m
            for k, m in enumerate(msgs)
            if m["role"] != "developer" or k >= lu
        ]
    lu, effort = last_user(msgs), ""
    if thinking and v41:
        effort = (
            f"Reasoning Effort: {EFFORT_V41.get(eff or 'high', eff)} "
            "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        )
    elif thinking and eff == "max":
        effort = EFFORT_MAX_V4
    prompt = BOS + (SYSTEM if v41 and (effort or msgs[0]["role"] == "system") else "") + effort
    for k, m in enumerate(msgs):
        role, last = m["role"], k == len(msgs) - 1
        if role in ("system", "developer"):
            prompt += SYSTEM if v41 and role == "system" and k > 0 else USER if role == "developer" else ""
            prompt += m["content"]
            if m.get("tools"):
                prompt += "\n\n" + TOOLS_TEMPLATE.format(
                    d=DSML, b=blk, i=inv, p=par, ts=THINK, te=END_THINK, schemas="\n".join(_json(t) for t in m["tools"])
                )
        elif role == "user":
            prompt += USER + "\n\n".join(
                t if kind == "text" else f"<tool_result>{t}</tool_result>" for kind, t, _ in m["blocks"]
            )
        else:
            prompt += (m["reasoning"] + END_THINK if thinking and (not drop or k > lu) else "") + m["content"]
            if m["calls"]:
                invokes = "\n".join(
                    f'<{DSML}{inv} name="{name}">\n'
                    + "\n".join(
                        f'<{DSML}{par} name="{key}" string="{str(isinstance(v, str)).lower()}">'
                        f"{v if isinstance(v, str) else _json(v)}</{DSML}{par}>"
                        for key, v in args.items()
                    )
                    + f"\n</{DSML}{inv}>"
                    for _, name, args in m["calls"]
                )
                prompt += f"\n\n<{DSML}{blk}>\n{invokes}\n</{DSML}{blk}>"
            prompt += EOS
        if last and not add_generation_prompt or not last and msgs[k + 1]["role"] != "assistant":
            continue
        if role in ("user", "developer") or (v41 and role == "system" and k > 0) or last:
            prompt += ASSISTANT + (THINK if thinking and (not drop or k >= lu) else END_THINK)
    return prompt


def chat_prompt_ids(tokenizer, messages: list[dict], max_tokens: int | None = None, **kw) -> list[int]:
    """``encode_chat`` then token ids, without a second BOS (the text starts with it). On a DeepSeek vocabulary
    (one that knows ``<｜User｜>``) every special string the format uses must be a single token. ``max_tokens``: as
    in ``Tokenizer.encode``."""
    needed = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML] + ([SYSTEM] if kw.get("version") == "v41" else [])
    if tokenizer.token_to_id(USER) is not None and (missing := [t for t in needed if tokenizer.token_to_id(t) is None]):
        raise ChatFormatError(
            f"tokenizer {getattr(tokenizer, 'name', '')!r} has no single token for {missing}; "
            f"use the checkpoint's own tokenizer for this chat format"
        )
    return tokenizer.encode(encode_chat(messages, **kw), add_bos=False, max_tokens=max_tokens)
