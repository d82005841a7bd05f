"""The output parser against the rules of spec tool_calling.md sections 5 and 6 (cases in the section 10
convention): each case passes whole, split at every character boundary, and fed one character at a time; the
concatenated deltas equal the final fields; a hypothesis property checks "any split == whole" on random markup."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsserve.parsers import CallArgs, CallStart, OutputParser, TextDelta, ToolCall, parse_output

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"


def v4(*invokes, opener="tool_calls"):
    return f"<{D}{opener}>\n" + "\n".join(invokes) + f"\n</{D}{opener}>"


def inv(name, *params, sp=""):
    body = "".join(f"\n{p}" for p in params)
    return f'<{D}{sp}invoke name="{name}">{body}\n</{D}{sp}invoke>'


def par(key, value, string=True, sp=""):
    return f'<{D}{sp}parameter name="{key}" string="{str(string).lower()}">{value}</{D}{sp}parameter>'


def v41(*invokes):
    return f"<{D} calls>\n" + "\n".join(invokes) + f"\n</{D} calls>"


W = ["get_weather", "now", "f", "g", "ns::search"]
C = ToolCall
PARIS = inv("get_weather", par("city", "Paris"), par("days", "3", False))
PARIS41 = inv("get_weather", par("city", "Paris", sp=" "), par("days", "3", False, sp=" "), sp=" ")
WEATHER = {"city": "Paris", "days": 3}

# (id, kwargs, text, content, reasoning, calls, finish)
CASES = [
    ("plain", {}, "Hello world", "Hello world", None, [], "stop"),
    ("think", {"thinking": True}, "Think.\n\n</think>\n\nAnswer.", "Answer.", "Think.", [], "stop"),
    ("think-leading-nl", {"thinking": True}, "\n\nThink\n</think>A", "A", "Think", [], "stop"),
    ("think-repeated-open", {"thinking": True}, "<think>a</think>b", "b", "a", [], "stop"),
    ("think-late-close", {"thinking": True}, "a</think>b</think>c", "bc", "a", [], "stop"),
    ("think-never-closed", {"thinking": True}, "all reasoning\n", "", "all reasoning\n", [], "stop"),
    ("nonthink-open-at-start", {}, "<think>hi", "hi", None, [], "stop"),
    ("nonthink-stray-close", {}, "a</think>b", "ab", None, [], "stop"),
    (
        "v41-call-thinking",
        {"thinking": True},
        "Need the tool.</think>\n\n" + v41(PARIS41),
        "",
        "Need the tool.",
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    (
        "v4-content-then-call",
        {"dialect": "v4"},
        "Let me check.\n\n" + v4(PARIS),
        "Let me check.",
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    (
        "v4-parallel",
        {"dialect": "v4"},
        v4(PARIS, inv("get_weather", par("city", "Rome"))),
        "",
        None,
        [C("get_weather", WEATHER), C("get_weather", {"city": "Rome"})],
        "tool_calls",
    ),
    (
        "v32-opener-from-v4",
        {"dialect": "v4"},
        v4(PARIS, opener="function_calls"),
        "",
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    ("v41-tags-in-v4-dialect", {"dialect": "v4"}, v41(PARIS41), "", None, [C("get_weather", WEATHER)], "tool_calls"),
    ("no-params", {}, v4(inv("now")), "", None, [C("now", {})], "tool_calls"),
    (
        "opener-ends-reasoning",
        {"thinking": True},
        "I will call.\n\n" + v4(PARIS),
        "",
        "I will call.",
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    (
        "string-raw",
        {},
        v4(inv("f", par("cmd", 'echo "a" \n<b> 2>&1 </x>'))),
        "",
        None,
        [C("f", {"cmd": 'echo "a" \n<b> 2>&1 </x>'})],
        "tool_calls",
    ),
    (
        "json-values",
        {},
        v4(
            inv(
                "f",
                par("l", "[1, 2]", False),
                par("b", " true ", False),
                par("n", "null", False),
                par("o", '{"k": "v"}', False),
            )
        ),
        "",
        None,
        [C("f", {"l": [1, 2], "b": True, "n": None, "o": {"k": "v"}})],
        "tool_calls",
    ),
    (
        "json-invalid-falls-back",
        {},
        v4(inv("f", par("a", '{"x": 1,', False), par("c", "NaN", False))),
        "",
        None,
        [C("f", {"a": '{"x": 1,', "c": "NaN"})],
        "tool_calls",
    ),
    (
        "duplicate-last-wins",
        {},
        v4(inv("f", par("a", "1"), par("a", "2"))),
        "",
        None,
        [C("f", {"a": "2"})],
        "tool_calls",
    ),
    ("mention-opener", {}, f"Wrap calls in <{D} calls> tags", f"Wrap calls in <{D} calls> tags", None, [], "stop"),
    (
        "block-junk-before-commit",
        {},
        f"Text\n\n<{D}tool_calls>\nhello\n</{D}tool_calls>",
        f"Text\n\n<{D}tool_calls>\nhello\n</{D}tool_calls>",
        None,
        [],
        "stop",
    ),
    (
        "invoke-junk-body",
        {},
        f'<{D}tool_calls>\n<{D}invoke name="f">\nhello\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}tool_calls>\n<{D}invoke name="f">\nhello\n</{D}invoke>\n</{D}tool_calls>',
        None,
        [],
        "stop",
    ),
    (
        "junk-after-param",
        {},
        v4(inv("f", par("a", "x"), "oops here ")),
        "oops here",
        None,
        [C("f", {"a": "x"})],
        "tool_calls",
    ),
    (
        "text-after-block",
        {},
        "Let me check.\n\n" + v4(PARIS) + "\n\nDone.",
        "Let me check.Done.",
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    ("whitespace-after-block", {}, v4(PARIS) + "\n \n", "", None, [C("get_weather", WEATHER)], "tool_calls"),
    (
        "second-block",
        {},
        v4(PARIS) + "\nThen\n\n" + v41(inv("now", sp=" ")),
        "Then",
        None,
        [C("get_weather", WEATHER), C("now", {})],
        "tool_calls",
    ),
    ("length-mid-opener", {"stop_reason": "length"}, f"Hi\n\n<{D}tool_ca", "Hi", None, [], "length"),
    ("length-mid-dsml-prefix", {"stop_reason": "length"}, "Hi <｜DS", "Hi ", None, [], "length"),
    ("length-lone-lt", {"stop_reason": "length"}, "2 <", "2 <", None, [], "length"),
    (
        "length-mid-string",
        {"stop_reason": "length"},
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par</{D}par',
        "",
        None,
        [C("get_weather", {})],
        "length",
    ),
    ("length-after-call", {"stop_reason": "length"}, v4(PARIS)[:-5], "", None, [C("get_weather", WEATHER)], "length"),
    (
        "eos-uncommitted-block",
        {},
        f'Hi\n\n<{D}tool_calls>\n<{D}invoke name="f">',
        f'Hi\n\n<{D}tool_calls>\n<{D}invoke name="f">',
        None,
        [],
        "stop",
    ),
    (
        "eos-open-string",
        {},
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris <',
        "",
        None,
        [C("get_weather", {"city": "Paris <"})],
        "tool_calls",
    ),
    (
        "eos-open-json",
        {},
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false"> 7',
        "",
        None,
        [C("f", {"n": 7})],
        "tool_calls",
    ),
    ("holdback-flush", {}, "2 <", "2 <", None, [], "stop"),
    ("holdback-flush-think-prefix", {}, "a </thi", "a </thi", None, [], "stop"),
    ("bare-invoke-declared", {}, "Sure.\n" + PARIS, "Sure.", None, [C("get_weather", WEATHER)], "tool_calls"),
    ("bare-invoke-undeclared", {}, inv("rm_rf", par("p", "/")), inv("rm_rf", par("p", "/")), None, [], "stop"),
    (
        "bare-invoke-unclosed",
        {},
        f'<{D}invoke name="f">\n{par("a", "1")}',
        f'<{D}invoke name="f">\n{par("a", "1")}',
        None,
        [],
        "stop",
    ),
    (
        "unknown-opener",
        {},
        v4(PARIS, opener="toolcalls") + "\nok",
        "ok",
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    ("no-tools-declared", {"tools": None}, "a\n\n" + v4(PARIS), "a\n\n" + v4(PARIS), None, [], "stop"),
    ("eos-spelling", {}, "Hi" + EOS, "Hi", None, [], "stop"),
    ("eos-after-block", {}, v4(PARIS) + EOS, "", None, [C("get_weather", WEATHER)], "tool_calls"),
    (
        "block-closer-ends-invoke",
        {},
        f'<{D}tool_calls>\n<{D}invoke name="f">\n{par("a", "1")}\n</{D}tool_calls>b',
        "b",
        None,
        [C("f", {"a": "1"})],
        "tool_calls",
    ),
    (
        "next-invoke-ends-invoke",
        {},
        f'<{D}tool_calls>\n<{D}invoke name="f">\n{par("a", "1")}\n{inv("g")}\n</{D}tool_calls>',
        "",
        None,
        [C("f", {"a": "1"}), C("g", {})],
        "tool_calls",
    ),
    ("stray-dsml-in-text", {}, f"a <{D} and b", f"a <{D} and b", None, [], "stop"),
    (
        "namespaced-name",
        {},
        v41(inv("ns::search", par("q", "x", sp=" "), sp=" ")),
        "",
        None,
        [C("ns::search", {"q": "x"})],
        "tool_calls",
    ),
    (
        "later-invoke-diverges",
        {},
        v4(PARIS)[: -len(f"</{D}tool_calls>")] + f'<{D}invoke name="g">junk',
        f'<{D}invoke name="g">junk',
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    ("reasoning-with-lt", {"thinking": True}, "if a<b and c</d\n\n</think>x", "x", "if a<b and c</d", [], "stop"),
    (
        "required-start-in-block",
        {"start_in_block": True},
        PARIS + f"\n</{D}tool_calls>",
        "",
        None,
        [C("get_weather", WEATHER)],
        "tool_calls",
    ),
    ("required-diverges", {"start_in_block": True}, "I cannot.", "I cannot.", None, [], "stop"),
    (
        "named-forced",
        {"forced_tool": "get_weather", "tools": []},
        par("city", "Paris") + f"\n</{D}invoke>\n</{D}tool_calls>",
        "",
        None,
        [C("get_weather", {"city": "Paris"})],
        "tool_calls",
    ),
    (
        "unicode",
        {},
        "héllo ✓ 世界\n\n" + v4(inv("f", par("s", '日本 "q" \\ \t')))[:],
        "héllo ✓ 世界",
        None,
        [C("f", {"s": '日本 "q" \\ \t'})],
        "tool_calls",
    ),
]
CLEAN = {  # no DSML may appear in any text delta of these
    c[0] for c in CASES if D not in c[3] and D not in (c[4] or "")
}


def run(text, pieces, **kw):
    stop = kw.pop("stop_reason", "eos")
    kw.setdefault("tools", W)
    p = OutputParser(**kw)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.close(stop)
    return p.finish(stop), events


def fold(events):
    text = {"content": "", "reasoning": ""}
    names, args = [], []
    for e in events:
        if isinstance(e, TextDelta):
            text[e.channel] += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(names)
            names.append(e.name)
            args.append("")
        else:
            assert isinstance(e, CallArgs) and e.index == len(names) - 1
            args[e.index] += e.text
    return text, names, args


def check_events(out, events, clean):
    text, names, args = fold(events)
    assert text["content"] == out.content
    assert text["reasoning"] == (out.reasoning_content or "")
    assert names == [c.name for c in out.tool_calls]
    assert args == [c.arguments_json for c in out.tool_calls]
    for c in out.tool_calls:
        if c.complete:
            assert json.loads(c.arguments_json) == c.arguments
    if clean:
        assert not any(isinstance(e, TextDelta) and D in e.text for e in events)


def splits(text):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_case_whole_and_every_split(case):
    name, kw, text, content, reasoning, calls, finish = case
    want = parse_output(text, **{"tools": W, **kw})
    assert (want.content, want.reasoning_content or None, want.tool_calls, want.finish_reason) == (
        content,
        reasoning,
        calls,
        finish,
    )
    for pieces in splits(text):
        out, events = run(text, pieces, **kw)
        assert out == want, pieces
        check_events(out, events, name in CLEAN)


def test_length_cut_keeps_streamed_fragments():
    case = next(c for c in CASES if c[0] == "length-mid-string")
    out = parse_output(case[2], tools=W, stop_reason="length")
    assert out.tool_calls[0].arguments_json == '{"city": "Par' and not out.tool_calls[0].complete


def test_string_values_stream_before_the_closer():
    p = OutputParser("v4", tools=W)
    p.feed(f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="s" string="true">abc')
    got = p.feed("def </")
    assert got == [CallArgs(0, "def ")]  # "</" may start the closer: held
    assert p.feed("x") == [CallArgs(0, "</x")]


def test_held_marker_prefix_is_not_emitted():
    p = OutputParser("v4", tools=W)
    assert p.feed("Hello\n\n<｜DSML｜tool") == [TextDelta("content", "Hello")]


def test_ended_in_reasoning_flag_and_dialect_check():
    assert parse_output("x", thinking=True).ended_in_reasoning
    assert not parse_output("x</think>y", thinking=True).ended_in_reasoning
    with pytest.raises(ValueError, match="dialect"):
        OutputParser("v5")


PIECES = [
    "<",
    "</",
    ">",
    "\n",
    "\n\n",
    " ",
    "a",
    '"',
    "x<y",
    "<think>",
    "</think>",
    EOS,
    f"<{D}tool_calls>",
    f"</{D}tool_calls>",
    f"<{D} calls>",
    f"<{D}toolcalls>",
    f'<{D}invoke name="f">',
    f'<{D} invoke name="get_weather">',
    f'<{D}invoke name="zz">',
    f"</{D}invoke>",
    f'<{D}parameter name="a" string="true">',
    f'<{D} parameter name="b" string="false">',
    f"</{D}parameter>",
    f"</{D} parameter>",
    "1",
    "[1,",
    "｜",
    D,
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(PIECES), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    thinking=st.booleans(),
    stop=st.sampled_from(["eos", "length"]),
)
def test_any_split_equals_whole(parts, cuts, thinking, stop):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    want = parse_output(text, thinking=thinking, tools=W, stop_reason=stop)
    out, events = run(text, pieces, thinking=thinking, stop_reason=stop)
    assert out == want
    check_events(out, events, clean=False)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from([p for p in PIECES if "think" not in p and p != EOS]), max_size=30))
def test_no_tools_loses_nothing(parts):
    """Without declared tools no markup is parsed: the content is the text, less its leading newlines."""
    text = "".join(parts)
    out, _ = run(text, list(text), tools=None)
    assert out.content == text.lstrip("\n") and out.tool_calls == []


DROPPED = [  # drop_malformed (the server's setting): malformed markup is dropped, never shown
    (
        f'The warehouse?<{D}parameter name="item" string="true">beads</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
        "The warehouse?beads\n\n",
    ),
    (f"The1}}</tool_result><{D}tool_calls>", "The1}</tool_result>"),
    (f"Wrap calls in <{D} calls> tags", "Wrap calls in  tags"),
    (f"Text\n\n<{D}tool_calls>\nhello\n</{D}tool_calls>", "Text\n\n\nhello\n"),
    (inv("zz", par("a", "1")), "1\n"),
    (v4(inv("f", par("a", "x"), "oops <b>")) + "\nok", "ok"),
    (f"a <{D} and b", "a "),
    (f"bare {D}x and ｜y", "bare x and ｜y"),
]


@pytest.mark.parametrize("text, content", DROPPED)
def test_drop_malformed(text, content):
    want = parse_output(text, tools=W, drop_malformed=True)
    assert want.content == content
    for pieces in splits(text):
        out, events = run(text, pieces, drop_malformed=True)
        assert out == want
        check_events(out, events, clean=True)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(PIECES), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    thinking=st.booleans(),
    tools=st.sampled_from([W, None]),
    stop=st.sampled_from(["eos", "length"]),
)
def test_drop_malformed_never_shows_dsml(parts, cuts, thinking, tools, stop):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    kw = dict(thinking=thinking, tools=tools, drop_malformed=True)
    want = parse_output(text, stop_reason=stop, **kw)
    out, events = run(text, pieces, stop_reason=stop, **kw)
    assert out == want
    check_events(out, events, clean=False)
    assert D not in out.content and D not in (out.reasoning_content or "")


# A tag released and dropped as stray markup (drop_malformed) in one delta, then a marker in a later delta: the
# marker must be read as itself at every split. CI once saw the streamed output keep "</think>" (hypothesis, cut 120).
CI_PARTS = ["x<y", "x<y", "</think>", f"</{D}invoke>", f"</{D}invoke>", f"<{D} calls>", f"</{D}invoke>"]
CI_PARTS += [f'<{D}parameter name="a" string="true">', "<think>", "<", "<", "<", "<", "</", EOS, EOS, "</think>"]
RELEASED = f"<{D} calls>b"  # no invoke follows: released, its tag dropped; at index 0 of the buffer
STALE = [  # (id, kwargs, text, content, reasoning, number of calls)
    ("ci-cut-120", {}, "".join(CI_PARTS), "x<yx<y<think><<<<</", None, 0),
    ("then-eos", {}, RELEASED + EOS + "c", "bc", None, 0),
    ("then-end-think-in-content", {}, RELEASED + "</think>c", "bc", None, 0),
    ("then-end-think-in-reasoning", {"thinking": True}, RELEASED + "</think>c", "c", "b", 0),
    ("then-think-in-reasoning", {"thinking": True}, RELEASED + "<think>c", "", "bc", 0),
    ("then-block", {}, RELEASED + v41(PARIS41), "b", None, 1),
]


@pytest.mark.parametrize("case", STALE, ids=[c[0] for c in STALE])
def test_released_tag_then_marker_every_split(case):
    name, kw, text, content, reasoning, n_calls = case
    kw = {"tools": W, "drop_malformed": True, **kw}
    want = parse_output(text, **kw)
    assert (want.content, want.reasoning_content or None, len(want.tool_calls)) == (content, reasoning, n_calls)
    for pieces in splits(text):
        out, events = run(text, pieces, **kw)
        assert out == want, pieces
        check_events(out, events, clean=True)


VALUE_HEAD = f'<{D} calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="{{}}">'


@pytest.mark.parametrize("drop_malformed", [False, True])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("string, raw", [("true", "x"), ("false", "1")])
@pytest.mark.parametrize("closed", [False, True])
def test_eos_spelled_inside_a_value(string, raw, closed, thinking, drop_malformed):
    """A value is raw text up to its closer (spec 4), so an EOS spelling inside one is data: kept in the value
    (a string="false" value that is then no JSON becomes a string), never shown in content or reasoning."""
    value = f"{raw}{EOS}y</think>"
    text = VALUE_HEAD.format(string) + value + (f"</{D}parameter>\n</{D}invoke>\n</{D} calls>" if closed else "")
    kw = {"tools": W, "thinking": thinking, "drop_malformed": drop_malformed}
    want = parse_output(text, **kw)
    assert want.tool_calls == [C("f", {"a": value})] and want.finish_reason == "tool_calls"
    assert want.content == "" and not want.reasoning_content
    for pieces in splits(text):
        out, events = run(text, pieces, **kw)
        assert out == want, pieces
        check_events(out, events, clean=True)
