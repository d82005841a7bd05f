"""Tools, tool_choice, reasoning and the DSML mask on the OpenAI surface (spec tool_calling.md 3.5, 6.7, 7).

Unit parts run without a model; the live part serves the built-in ``tiny-trained`` model (its training chats hold
V4 tool calls for a ``stock`` tool) and samples many requests concurrently at temperature 0.8."""

import asyncio
import importlib.util
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import SERVER_ARGS, live_server

from dsserve.engine.sampler import Sampler, SamplingRow
from dsserve.engine.sampling_params import SamplingParams
from dsserve.models.tokenizer import Tokenizer
from dsserve.server import tool_calls as tc
from dsserve.server.chat import encode_chat
from dsserve.train.tasks import STOCK_TOOL

D = "｜DSML｜"
STOCK = STOCK_TOOL  # the tool the built-in model was trained to call
OTHER = {
    "type": "function",
    "function": {"name": "other", "description": "d", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "How many apples are in the north warehouse?"}]
HAS_RECIPE = importlib.util.find_spec("deepseek_recipe") is not None


# ---------------------------------------------------------------- planning and errors
def test_plan_tool_choice():
    auto = tc.plan_tools([STOCK], None, True, thinking=True, dialect="v4")
    assert auto.names == ("stock",) and auto.prompt_tools == [STOCK] and not auto.ban_dsml and not auto.prefill
    none = tc.plan_tools([STOCK], "none", True, thinking=False, dialect="v4")
    assert none.prompt_tools is None and none.names == () and none.ban_dsml
    assert tc.plan_tools(None, None, True, thinking=False, dialect="v4").ban_dsml
    req = tc.plan_tools([STOCK, OTHER], "required", True, thinking=False, dialect="v41")
    assert req.prefill == f"\n\n<{D} calls>\n" and req.dialect == "v4.1" and req.prompt_tools == [STOCK, OTHER]
    named = tc.plan_tools(
        [STOCK, OTHER], {"type": "function", "function": {"name": "other"}}, False, thinking=False, dialect="v4"
    )
    assert named.prompt_tools == [OTHER] and named.names == ("other",) and named.prefill == f"\n\n<{D}tool_calls>\n"


@pytest.mark.skipif(not tc.grammar_available(), reason="the grammar extra (xgrammar) is not installed")
def test_plan_with_grammar_constrains_instead_of_prefilling():
    named = {"type": "function", "function": {"name": "other"}}
    for choice, thinking in (("required", False), ("required", True), (named, True)):
        p = tc.plan_tools([STOCK, OTHER], choice, True, thinking=thinking, dialect="v41", grammar=True)
        tag = json.loads(p.structural_tag)
        assert p.prefill == "" and tag["type"] == "structural_tag" and f"<{D} calls>" in p.structural_tag
        assert p.names == (("stock", "other") if choice == "required" else ("other",))
    assert tc.plan_tools([STOCK], "auto", True, thinking=True, dialect="v4", grammar=True).structural_tag is None


STRICT = {"type": "function", "function": dict(STOCK["function"], strict=True)}


@pytest.mark.skipif(not tc.grammar_available(), reason="the grammar extra (xgrammar) is not installed")
def test_plan_strict_tools_under_auto_are_constrained_once_triggered():
    for thinking in (False, True):
        p = tc.plan_tools([STRICT, OTHER], "auto", True, thinking=thinking, dialect="v4", grammar=True)
        tag = json.loads(p.structural_tag)
        assert p.prefill == "" and p.names == ("stock", "other") and not p.ban_dsml
        assert f"<{D}tool_calls>" in p.structural_tag and "triggered_tags" in p.structural_tag, tag
    loose = {"type": "function", "function": dict(STOCK["function"], strict="yes")}  # only true counts, as OpenAI
    assert tc.plan_tools([loose], "auto", True, thinking=False, dialect="v4", grammar=True).structural_tag is None
    assert tc.plan_tools([STRICT], "auto", True, thinking=False, dialect="v4", grammar=False).structural_tag is None


@pytest.mark.parametrize(
    "tools, choice, thinking, field, words",
    [
        ([STOCK], {"type": "function", "function": {"name": "nope"}}, False, "tool_choice", "'nope'"),
        ([STOCK], "required", True, "tool_choice", "Thinking mode does not support"),
        ([STOCK], "sometimes", False, "tool_choice", "'sometimes'"),
        (None, "required", False, "tool_choice", "at least one tool"),
        ([{"type": "function"}], None, False, "tools", r"tools\[0\]"),
        ([{"type": "function", "function": {"name": ""}}], None, False, "tools", "name"),
    ],
)
def test_plan_errors_name_the_field(tools, choice, thinking, field, words):
    with pytest.raises(tc.ToolChoiceError, match=words) as e:
        tc.plan_tools(tools, choice, True, thinking=thinking, dialect="v4")
    assert e.value.field == field


def test_thinking_controls():
    assert tc.thinking_mode({"thinking": True}, None, None) == (True, None)
    assert tc.thinking_mode({"enable_thinking": True}, {"type": "disabled"}, None) == (False, None)
    assert tc.thinking_mode(None, {"type": "enabled"}, "xhigh") == (True, "high")
    assert tc.thinking_mode(None, {"type": "enabled"}, "none") == (False, None)
    assert tc.thinking_mode(None, None, 30) == (True, 30)  # an effort alone turns thinking on (vLLM's rule)
    assert tc.thinking_mode({"thinking": False}, None, 30) == (False, None)  # an explicit switch wins
    with pytest.raises(tc.ToolChoiceError, match="reasoning_effort"):
        tc.thinking_mode(None, None, "extreme")
    with pytest.raises(tc.ToolChoiceError, match="thinking"):
        tc.thinking_mode(None, {"type": "on"}, None)


# ---------------------------------------------------------------- the DSML mask
def test_dsml_bans_cover_every_tokenization():
    """With the banned ids removed, no sequence of tiny-vocabulary tokens can spell the DSML marker: a token that
    holds it or ends with a proper prefix of its bytes is banned, and the marker has to start in some token."""
    tok = Tokenizer.for_preset("tiny")
    bans = set(tc.dsml_bans(tok))
    assert bans and len(bans) < tok.vocab_size // 10
    assert any(i in bans for i in tok.encode(f"<{D}tool_calls>", add_bos=False))
    allowed = [i for i in range(tok.vocab_size) if i not in bans]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # random streams of allowed tokens, weighted towards the marker's own pieces
        pieces = tok.encode(f"a<{D}invoke ｜x", add_bos=False)
        ids = [
            pieces[int(torch.randint(len(pieces), (1,), generator=g))]
            if torch.rand(1, generator=g) < 0.5
            else allowed[int(torch.randint(len(allowed), (1,), generator=g))]
            for _ in range(200)
        ]
        ids = [i for i in ids if i not in bans]
        assert D not in tok.decode(ids)


def test_sampler_never_draws_a_banned_token():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 50.0  # the favourite is banned
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, banned_token_ids=[4])),
        SamplingRow(SamplingParams(temperature=1.0, banned_token_ids=[4, 5])),
        SamplingRow(SamplingParams(temperature=0.0)),
    ]
    for _ in range(20):
        got = Sampler()(logits, rows).sampled_token_ids.tolist()
        assert got[0] != 4 and got[1] not in (4, 5) and got[2] == 4
    with pytest.raises(ValueError, match="banned_token_ids"):
        SamplingParams(banned_token_ids=[-1])


# ---------------------------------------------------------------- shaping
OUT = (
    f"Hm.</think>Checking.\n\n<{D}tool_calls>\n"
    + "\n".join(
        f'<{D}invoke name="stock">\n<{D}parameter name="item" string="true">{i}</{D}parameter>\n</{D}invoke>'
        for i in ("apples", 'a "pen"')
    )
    + f"\n</{D}tool_calls>"
)


@pytest.mark.parametrize("parallel", [True, False])
def test_stream_chunks_fold_to_the_message(parallel):
    plan = tc.plan_tools([STOCK], "auto", parallel, thinking=True, dialect="v4")
    whole = tc.ChoiceShaper(plan)
    whole.feed(OUT)
    whole.close("stop")
    msg = whole.message()
    shaper, chunks = tc.ChoiceShaper(plan), []
    for k in range(0, len(OUT), 3):
        chunks += tc.stream_chunks(shaper, "r", "m", 0, OUT[k : k + 3], None, None)
    chunks += tc.stream_chunks(shaper, "r", "m", 0, "", "stop", None)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" == whole.finish_reason
    folded = {"content": "", "reasoning_content": "", "reasoning": "", "calls": {}}
    for ch in chunks:
        d = ch["choices"][0]["delta"]
        assert D not in d.get("content", "") + d.get("reasoning_content", "")
        for k in ("content", "reasoning_content", "reasoning"):
            folded[k] += d.get(k, "")
        for t in d.get("tool_calls", []):
            c = folded["calls"].setdefault(t["index"], {"name": "", "arguments": "", "id": None})
            c["id"] = t.get("id", c["id"])
            c["name"] += t.get("function", {}).get("name", "")
            c["arguments"] += t["function"]["arguments"]
    assert folded["content"] == msg["content"] == "Checking."
    assert folded["reasoning_content"] == folded["reasoning"] == msg["reasoning_content"] == "Hm."
    calls = [folded["calls"][i] for i in sorted(folded["calls"])]
    want = [{"item": "apples"}, {"item": 'a "pen"'}][: 2 if parallel else 1]
    assert [json.loads(c["arguments"]) for c in calls] == want
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == want
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == len(calls)


def test_length_is_reported_even_with_calls():
    plan = tc.plan_tools([STOCK], "auto", True, thinking=False, dialect="v4")
    s = tc.ChoiceShaper(plan)
    s.feed(OUT.split("</think>")[1][:-20])
    s.close("length")
    assert s.finish_reason == "length" and len(s.message()["tool_calls"]) == 2


# ---------------------------------------------------------------- stop strings: the content channel only (spec 6.9)
BLOCK_NN = (
    f'<{D}tool_calls>\n<{D}invoke name="stock">\n<{D}parameter name="item" string="true">a\n\nb</{D}parameter>'
    f"\n</{D}invoke>\n</{D}tool_calls>"
)
STOP_CASES = [  # (output after the thinking prompt, stops, include, content, finish, stop_reason, calls)
    ("R1\n\nR2</think>Call.\n\n" + BLOCK_NN, ["\n\n"], False, "Call.", "tool_calls", None, 1),
    ("R1\n\nR2</think>Hello\n\nWorld", ["\n\n"], False, "Hello", "stop", "\n\n", 0),
    ("R1\n\nR2</think>" + BLOCK_NN + "\n\nDone.\n\nMore", ["\n\n"], False, "Done.", "tool_calls", "\n\n", 1),
    ("R1 END R2</think>Go END now END", ["END", "\n\n"], True, "Go END", "stop", "END", 0),
    ("R1\n\nR2</think>no stop here", ["\n\n"], False, "no stop here", "stop", None, 0),
]


def _run_shaper(plan, pieces, stops, include):
    s, deltas = tc.ChoiceShaper(plan, stops, include), []
    for piece in pieces:
        chunks = tc.stream_chunks(s, "r", "m", 0, piece, None, None)
        deltas += [c["choices"][0] for c in chunks]
        if s.stopped:
            break
    deltas += [c["choices"][0] for c in tc.stream_chunks(s, "r", "m", 0, "", "abort" if s.stopped else "stop", None)]
    return s, deltas


@pytest.mark.parametrize("case", range(len(STOP_CASES)))
def test_stop_strings_cut_content_only_at_every_split(case):
    """A stop string inside reasoning or inside a DSML parameter value does not cut; in content it ends the reply
    (the request is then aborted: the engine's "abort" that follows changes nothing). Whole, split in two at every
    boundary, and one character at a time, streamed and folded into the message alike."""
    out, stops, include, content, finish, reason, n_calls = STOP_CASES[case]
    plan = tc.plan_tools([STOCK], "auto", True, thinking=True, dialect="v4")
    splits = [[out], list(out), *([out[:k], out[k:]] for k in range(1, len(out)))]
    for pieces in splits:
        s, deltas = _run_shaper(plan, pieces, stops, include)
        msg = s.message()
        assert (msg["content"] or "", msg["reasoning_content"]) == (content, out.split("</think>")[0]), pieces
        assert (s.finish_reason, s.stop_reason) == (finish, reason), pieces
        assert [json.loads(c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == [
            {"item": "a\n\nb"}
        ] * n_calls
        assert "".join(d["delta"].get("content", "") for d in deltas) == content
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == [finish]


def test_stop_strings_go_to_the_shaper_only_with_other_channels():
    params = SamplingParams(stop=["\n\n"])
    plain = tc.plan_tools(None, None, True, thinking=False, dialect="v4")
    assert not tc.content_stops(plain, params)  # no reasoning, no calls: the engine's stop check, unchanged
    assert tc.content_stops(tc.plan_tools(None, None, True, thinking=True, dialect="v4"), params)
    assert tc.content_stops(tc.plan_tools([STOCK], "auto", True, thinking=False, dialect="v4"), params)
    assert not tc.content_stops(tc.plan_tools([STOCK], "auto", True, thinking=False, dialect="v4"), SamplingParams())


# ---------------------------------------------------------------- the prompt, against DeepSeek's own renderer
@pytest.mark.skipif(not HAS_RECIPE, reason="deepseek-recipe (a test extra) not installed")
@pytest.mark.parametrize("version", ["v4", "v41"])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_prompt_matches_deepseek_recipe(version, thinking, choice):
    import deepseek_recipe as dr

    if thinking and choice != "auto":
        pytest.skip("refused in thinking mode (tested above)")
    call = lambda i, item: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "stock", "arguments": json.dumps({"item": item, "warehouse": "north"})},
    }
    msgs = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two.",
            "tool_calls": [call("c1", "a"), call("c2", "b")],
        },
        {"role": "tool", "tool_call_id": "c2", "content": '{"count": 2}'},
        {"role": "tool", "tool_call_id": "c1", "content": '{"count": 1}'},
    ]
    tool_choice = {"type": "function", "function": {"name": "other"}} if choice == "named" else choice
    model = "DeepSeek-V4.1-Flash" if version == "v41" else "DeepSeek-V4-Pro"
    body = {
        "model": model,
        "messages": msgs,
        "tools": [STOCK, OTHER],
        "tool_choice": tool_choice,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if thinking and version == "v4":  # recipe 0.2.0 adds an effort paragraph at its default effort; low has none
        body["reasoning_effort"] = "low"
    conv = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation
    want = (dr.DeepseekV41Encoding() if version == "v41" else dr.DeepseekV4Encoding()).render_conversation(conv).prompt
    plan = tc.plan_tools([STOCK, OTHER], tool_choice, True, thinking=thinking, dialect=version)
    got = encode_chat(msgs, thinking=thinking, tools=plan.prompt_tools, version=plan.encoder_version) + plan.prefill
    assert got == want


# ---------------------------------------------------------------- live
@pytest.fixture(scope="module")
def base():
    args = [a if a != "float64" else "float32" for a in SERVER_ARGS]
    args[args.index("--max-num-seqs") + 1] = "32"
    with live_server("tiny-trained", args) as url:
        yield url


N_SAMPLED = 32  # the 200: benchmarks/tool_calls_live.py (results in benchmarks/results/tool-calls-live-cpu)


def _sample(base, n, stream, **extra):
    """n concurrent chat requests with tools at temperature 0.8, each with its own seed."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(seed):
        kw = dict(model="tiny-trained", messages=ASK, temperature=0.8, max_tokens=160, seed=seed)
        kw.update(extra)
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0], None
        deltas, finish = [], None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                deltas.append(chunk.choices[0].delta)
                finish = chunk.choices[0].finish_reason or finish
        return finish, deltas

    async def all_():
        try:
            return await asyncio.gather(*(one(s) for s in range(n)))
        finally:
            await client.close()

    return asyncio.run(all_())


def _fold(deltas):
    content, calls = "", {}
    for d in deltas:
        assert D not in (d.content or "")
        content += d.content or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"name": "", "arguments": ""})
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
    return content, [calls[i] for i in sorted(calls)]


def test_live_tool_calls_sampled_no_dsml_leaks(base):
    """Sampled requests with tools, streamed and not: calls parsed, no DSML in any content or delta."""
    counts = {"tool_calls": 0, "stop": 0, "length": 0}
    for choice, _ in _sample(base, N_SAMPLED, False, tools=[STOCK]):
        msg = choice.message
        assert D not in (msg.content or "") and D not in json.dumps(msg.model_dump())
        for c in msg.tool_calls or []:
            assert c.function.name == "stock" and c.id.startswith("call_") and c.type == "function"
            if choice.finish_reason == "tool_calls":
                assert set(json.loads(c.function.arguments)) <= {"item", "warehouse"}
        assert (choice.finish_reason == "tool_calls") == bool(msg.tool_calls) or choice.finish_reason == "length"
        counts[choice.finish_reason] += 1
    for finish, deltas in _sample(base, N_SAMPLED // 2, True, tools=[STOCK]):
        content, calls = _fold(deltas)  # asserts no DSML in any content delta
        assert D not in content and all(D not in c["arguments"] for c in calls)
        if finish == "tool_calls":
            assert calls and all(c["name"] == "stock" and json.loads(c["arguments"]) for c in calls)
        counts[finish] += 1
    assert counts["tool_calls"] >= 1, f"the trained model should call its tool in some samples: {counts}"


def test_live_tool_choice_none_masks_dsml(base):
    # the tools block is still rendered by hand in the system prompt, so the model is tempted to call
    prompt_tools = encode_chat([{"role": "system", "content": ""}], tools=[STOCK], add_generation_prompt=False)
    sys_msg = {"role": "system", "content": prompt_tools.split("\n\n", 1)[1]}
    got = _sample(base, 8, False, tools=[STOCK], tool_choice="none", messages=[sys_msg, *ASK], max_tokens=60)
    for choice, _ in got:
        assert not choice.message.tool_calls and D not in (choice.message.content or "")
        assert choice.finish_reason in ("stop", "length")


def test_live_required_and_errors(base):
    import openai

    # greedy, with the block opener prefilled: the trained model's call, parsed, streamed and not
    named = {"type": "function", "function": {"name": "stock"}}
    for choice in ("required", named):
        (c, _), (finish, deltas) = (
            _sample(base, 1, False, tools=[STOCK], tool_choice=choice, temperature=0)[0],
            (_sample(base, 1, True, tools=[STOCK], tool_choice=choice, temperature=0)[0]),
        )
        assert c.finish_reason == finish == "tool_calls" and c.message.content is None
        want = {"item": "apples", "warehouse": "north"}
        assert json.loads(c.message.tool_calls[0].function.arguments) == want
        content, calls = _fold(deltas)
        assert content == "" and [json.loads(x["arguments"]) for x in calls] == [want]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'nope'") as e:
        client.chat.completions.create(
            model="tiny-trained",
            messages=ASK,
            tools=[STOCK],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    # with the grammar extra, thinking + required is constrained, not refused: reasoning, then the block
    r = client.chat.completions.create(
        model="tiny-trained",
        messages=ASK,
        tools=[STOCK],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
        extra_body={"thinking": {"type": "enabled"}},
    )
    assert r.choices[0].finish_reason in ("length", "tool_calls") and D not in str(r.choices[0].message)
    # reasoning: thinking on, the reply comes back in reasoning_content (the tiny model never learned </think>)
    r = client.chat.completions.create(
        model="tiny-trained", messages=ASK, max_tokens=8, temperature=0, extra_body={"thinking": {"type": "enabled"}}
    )
    extra = r.choices[0].message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] and extra["reasoning_content"]


def test_live_stop_strings_apply_to_content_only(base):
    """Greedy: the trained model reasons and answers "The river warehouse has N things.\nAnswer: N\n". With
    thinking, a stop "\n" leaves the reasoning whole; with tools, a stop "warehouse" cuts the content, ends with
    "stop" and aborts the request at once (fewer completion tokens than without the stop)."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    def ask(**kw):
        return client.chat.completions.create(model="tiny-trained", messages=ASK, temperature=0, max_tokens=40, **kw)

    think = dict(extra_body={"thinking": {"type": "enabled"}})
    free, cut = ask(**think), ask(stop=["\n"], **think)
    reasoning = free.choices[0].message.model_extra["reasoning_content"]
    assert "\n" in reasoning.strip() and cut.choices[0].message.model_extra["reasoning_content"] == reasoning
    assert cut.choices[0].finish_reason == free.choices[0].finish_reason
    free, cut = ask(tools=[STOCK]), ask(tools=[STOCK], stop=["warehouse"])
    text = free.choices[0].message.content
    assert "warehouse" in text and cut.choices[0].message.content == text.split("warehouse")[0]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == "warehouse"
    assert cut.usage.completion_tokens < free.usage.completion_tokens, "aborted once the content hit the stop"
    finish, deltas = _sample(base, 1, True, tools=[STOCK], stop=["warehouse"], temperature=0, max_tokens=40)[0]
    assert finish == "stop" and _fold(deltas) == (text.split("warehouse")[0], [])


@pytest.mark.skipif(not tc.grammar_available(), reason="the grammar extra (xgrammar) not installed")
def test_live_constrained_outputs_are_valid(base):
    """8 sampled requests (temperature 0.8) each for tool_choice required, a named function and a json_schema
    response_format, streamed and not, all concurrent: every one a call to an allowed tool with arguments valid
    against its schema, or JSON valid against the response schema (benchmarks/tool_choice_validity.py runs 50)."""
    pytest.importorskip("jsonschema")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "tool_choice_validity.py")
    spec = importlib.util.spec_from_file_location("tool_choice_validity", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = asyncio.run(bench.run(base, 8, 200, 48))
    assert res["failures"] == [] and all(c == {"requests": 8, "valid": 8} for c in res["counts"].values()), res
    assert bench.check("named", "tool_calls", None, [{"name": "stock", "arguments": "{}"}])  # the check can fail
    assert bench.check("json_schema", "stop", '{"item": "a", "count": -1, "sure": true}', [])


@pytest.mark.skipif(not tc.grammar_available(), reason="the grammar extra (xgrammar) not installed")
def test_live_strict_tool_under_auto_follows_its_schema(base):
    """A strict tool whose item must be "pears" (the trained model calls it for the asked item, apples): sampled
    under auto, the model still answers in text or calls, and every call it opens follows the schema."""
    fn = dict(STOCK["function"], strict=True)
    fn["parameters"] = dict(fn["parameters"], properties={"item": {"enum": ["pears"]}, "warehouse": {"type": "string"}})
    strict = {"type": "function", "function": fn}
    got = _sample(base, 24, False, tools=[strict])
    calls = [c for choice, _ in got for c in choice.message.tool_calls or []]
    assert calls, f"the trained model should call its tool in some samples: {[c.finish_reason for c, _ in got]}"
    assert all(json.loads(c.function.arguments)["item"] == "pears" for c in calls)
    assert all(D not in (c.message.content or "") for c, _ in got)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 200) | st.sampled_from(["auto", "none", "required", "stock", "high"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["type", "function", "name", "parameters", "thinking"]), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(tools=JSONISH, choice=JSONISH, parallel=JSONISH, kwargs=JSONISH, thinking=JSONISH, effort=JSONISH)
def test_fuzzed_tool_fields_are_planned_or_refused(tools, choice, parallel, kwargs, thinking, effort):
    """Any JSON in these fields gives a plan or a ToolChoiceError (a 400 naming the field), never another error."""
    try:
        on, eff = tc.thinking_mode(kwargs if isinstance(kwargs, dict) else None, thinking, effort)
        tc.plan_tools(tools, choice, parallel, thinking=on, dialect="v4")
    except tc.ToolChoiceError as e:
        assert e.field in ("tools", "tool_choice", "parallel_tool_calls", "thinking", "reasoning_effort", "dialect")
