"""The Anthropic Messages API: request conversion, and the ``anthropic`` client unchanged against a live server
(``tiny-trained``, whose training chats call a ``stock`` tool) with an API key sent as ``x-api-key``."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import SERVER_ARGS, live_server

from dsserve.server.anthropic import MessagesError, MessagesRequest, to_chat
from dsserve.server.chat import encode_chat

anthropic = pytest.importorskip("anthropic")
D = "｜DSML｜"
MODEL = "tiny-trained"
STOCK = {
    "name": "stock",
    "description": "How many of an item a warehouse holds",
    "input_schema": {
        "type": "object",
        "properties": {"item": {"type": "string"}, "warehouse": {"type": "string"}},
        "required": ["item", "warehouse"],
    },
}
ASK = "How many apples are in the north warehouse?"
ROUND = [
    {"role": "user", "content": ASK},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": ""},
            {"type": "tool_use", "id": "call_0", "name": "stock", "input": {"item": "apples", "warehouse": "north"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0", "content": '{"count": 42}'}]},
]


def test_messages_render_as_the_openai_chat():
    req = MessagesRequest(model=MODEL, max_tokens=5, system="S", messages=ROUND, tools=[STOCK])
    msgs, tools = to_chat(req)
    openai_msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "stock", "arguments": '{"item": "apples", "warehouse": "north"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": '{"count": 42}'},
    ]
    openai_tools = [
        {
            "type": "function",
            "function": {**{k: STOCK[k] for k in ("name", "description")}, "parameters": STOCK["input_schema"]},
        }
    ]
    assert tools == openai_tools
    for thinking in (False, True):
        assert encode_chat(msgs, tools=tools, thinking=thinking) == encode_chat(
            openai_msgs, tools=openai_tools, thinking=thinking
        )
    bad = MessagesRequest(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(MessagesError, match=r"messages\[0\].content\[0\]: unsupported block type 'image'"):
        to_chat(bad)


@pytest.fixture(scope="module")
def base():
    args = [a if a != "float64" else "float32" for a in SERVER_ARGS]
    args[args.index("--max-num-seqs") + 1] = "32"
    with live_server(MODEL, [*args, "--api-key", "sekret"]) as url:
        yield url


def test_auth_and_errors(base):
    import httpx

    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(base + "/v1/messages", json=body).status_code == 401
    assert httpx.post(base + "/v1/messages", json=body, headers={"x-api-key": "nope"}).status_code == 401
    client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)
    r = client.messages.create(**body)
    assert r.type == "message" and r.role == "assistant" and r.usage.output_tokens >= 1
    with pytest.raises(anthropic.BadRequestError, match="'nope'"):
        client.messages.create(**body, tools=[STOCK], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=0, messages=body["messages"])
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(**{**body, "model": "claude-other"})


def _sample(base, n, stream):
    client = anthropic.AsyncAnthropic(base_url=base, api_key="sekret", max_retries=0, timeout=300)

    async def one(k):
        kw = dict(model=MODEL, max_tokens=160, tools=[STOCK], messages=[{"role": "user", "content": ASK}])
        kw["extra_body"] = {"temperature": 0.8}  # the SDK no longer takes sampling fields as arguments
        if not stream:
            return await client.messages.create(**kw)
        async with client.messages.stream(**kw) as s:
            async for _ in s:
                pass
            return await s.get_final_message()

    async def all_():
        try:
            return await asyncio.gather(*(one(k) for k in range(n)))
        finally:
            await client.close()

    return asyncio.run(all_())


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_tool_use(base, stream):
    """Sampled at temperature 0.8: whatever the model writes, the reply is well-formed and shows no DSML."""
    replies = _sample(base, 16 if not stream else 8, stream)
    for r in replies:
        assert r.stop_reason in ("tool_use", "end_turn", "max_tokens")
        for b in r.content:
            assert b.type in ("text", "tool_use")
            if b.type == "text":
                assert D not in b.text
            else:
                assert b.name == "stock" and isinstance(b.input, dict) and b.id.startswith("toolu_")
                if r.stop_reason == "tool_use":
                    assert set(b.input) <= {"item", "warehouse"}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_calls_the_tool(base, stream):
    """Greedy with tool_choice any (the block opener prefilled): the trained model's call, parsed."""
    client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)
    kw = dict(
        model=MODEL,
        max_tokens=160,
        tools=[STOCK],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": ASK}],
        extra_body={"temperature": 0},
    )
    if stream:
        with client.messages.stream(**kw) as s:
            kinds = {e.type for e in s}
            r = s.get_final_message()
        assert {"message_start", "content_block_start", "content_block_delta", "message_stop"} <= kinds
    else:
        r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    assert r.content[0].name == "stock" and r.content[0].input == {"item": "apples", "warehouse": "north"}


def test_tool_result_round_and_thinking(base):
    client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)
    r = client.messages.create(model=MODEL, max_tokens=40, tools=[STOCK], messages=ROUND, extra_body={"temperature": 0})
    assert r.stop_reason == "end_turn" and r.content[0].type == "text"
    assert "42" in r.content[0].text  # the model states the tool's result, as it was trained to
    th = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert th.content[0].type == "thinking" and th.stop_reason == "max_tokens"
    with client.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as s:
        kinds = [e.type for e in s]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert s.get_final_message().content[0].type == "thinking"


def test_stop_sequences_end_the_text_only(base):
    """Spec 6.9, greedy: the trained model reasons and answers "The river warehouse has N things.\nAnswer: N\n".
    With thinking, a stop "\n" leaves the thinking whole; with tools, a stop "warehouse" cuts the text, ends with
    stop_reason stop_sequence naming it, and aborts the request at once (fewer output tokens); streamed the same."""
    client = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0)

    def ask(stream=False, **kw):
        kw = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": ASK}], **kw)
        kw["extra_body"] = {"temperature": 0}
        if not stream:
            return client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            return s.get_final_message()

    think = dict(thinking={"type": "enabled", "budget_tokens": 1024})
    free = ask(**think)
    reasoning = free.content[0].thinking
    assert free.content[0].type == "thinking" and "\n" in reasoning.strip()
    for stream in (False, True):
        cut = ask(stream, stop_sequences=["\n"], **think)
        assert cut.content[0].thinking == reasoning and cut.stop_reason == free.stop_reason, (stream, cut)
    free = ask(tools=[STOCK])
    text = free.content[0].text
    assert "warehouse" in text and free.stop_reason != "stop_sequence"
    for stream in (False, True):
        cut = ask(stream, tools=[STOCK], stop_sequences=["warehouse"])
        assert [b.type for b in cut.content] == ["text"] and cut.content[0].text == text.split("warehouse")[0]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "warehouse", (stream, cut)
        assert cut.usage.output_tokens < free.usage.output_tokens, "aborted once the text hit the stop"


BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "redacted_thinking"])},
    optional={
        "text": st.one_of(st.text(max_size=5), st.integers()),
        "name": st.one_of(st.just("stock"), st.integers()),
        "input": st.one_of(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.lists(st.integers())),
        "id": st.text(max_size=3),
        "tool_use_id": st.one_of(st.text(max_size=3), st.none()),
        "content": st.one_of(
            st.text(max_size=5), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}))
        ),
        "thinking": st.text(max_size=5),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["user", "assistant"]), st.lists(BLOCK, max_size=3)), min_size=1, max_size=4
    )
)
def test_fuzzed_blocks_convert_or_are_refused(turns):
    """Any block mix converts to a chat the encoder renders, or is a MessagesError (a 400 naming the block)."""
    req = MessagesRequest(model=MODEL, max_tokens=5, messages=[{"role": r, "content": b} for r, b in turns])
    try:
        msgs, tools = to_chat(req)
    except MessagesError as e:
        assert e.status == 400 and "messages[" in e.message
        return
    if msgs:
        try:
            encode_chat(msgs, tools=tools)
        except ValueError as e:  # ChatFormatError: a 400 as well
            assert "messages" in str(e)
