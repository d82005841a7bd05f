"""The synthetic tasks (issue 10): deterministic, held-out problems never produced by training seeds, answers that
follow from the problems, retrieval facts out of a window-only model's sight."""

import re

import pytest

from dsserve.models.tokenizer import Tokenizer
from dsserve.server.chat import ASSISTANT, END_THINK
from dsserve.train.tasks import TASKS, final_answer, problem, prompt_ids, split_of

TOK = Tokenizer.for_preset("tiny")


def count(s):
    return len(TOK.encode(s, add_bos=False))


@pytest.mark.parametrize("task", TASKS)
def test_problems_are_deterministic_and_split_by_hash(task):
    ev = [problem(task, "eval", i, count, 128) for i in range(20)]
    assert ev == [problem(task, "eval", i, count, 128) for i in range(20)]
    assert all(split_of(p.prompt) == "eval" for p in ev)
    train = {problem(task, "train", i, count, 128).prompt for i in range(200)}
    assert not train & {p.prompt for p in ev}  # held out by construction, not by luck of the seeds
    assert len({p.prompt for p in ev}) == 20
    for p in ev:
        assert final_answer(p.completion) == p.answer
        assert p.prompt.startswith(p.context)


def test_arithmetic_solutions_add_up():
    for i in range(30):
        p = problem("arithmetic", "eval", i)
        steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", p.completion)
        assert 2 <= len(steps) <= 4
        for a, op, b, c in steps:
            assert eval(f"{a} {op} {b}") == int(c)
        assert steps[-1][3] == p.answer
        assert p.context.endswith(f"Answer: {final_answer(p.context)}\n\n")  # a worked problem before it


def test_retrieval_fact_is_far_back_and_unique():
    """The asked fact lies at least min_back tokens before the question, and which fact it is varies (not always
    the first: a model could answer "the first fact's code" without looking the key up)."""
    places = set()
    for i in range(20):
        p = problem("retrieval", "eval", i, count, 128)
        key = re.search(r"What is the code for (\w+)\?", p.prompt).group(1)
        assert p.prompt.count(f"The code for {key} is ") == 1
        at = p.prompt.index(f"The code for {key} is {p.answer}.")
        places.add(p.prompt[:at].count("\n"))
        after = p.prompt[at + len(f"The code for {key} is {p.answer}.\n") :]
        assert count(after) >= 128
    assert len(places) > 3 and 0 in places


def test_chat_turns_end_in_a_tool_result_and_the_reply_states_it():
    for i in range(10):
        p = problem("chat", "eval", i)
        assert p.prompt.endswith(ASSISTANT + END_THINK)
        assert p.prompt.removesuffix(ASSISTANT + END_THINK).endswith(f'{{"count": {p.answer}}}</tool_result>')
        assert p.context and p.prompt.startswith(p.context)


def test_final_answer_takes_the_first_answer_line():
    assert final_answer(" 3 + 4 = 7.\nAnswer: 7\nQuestion: ...\nAnswer: 9") == "7"
    assert final_answer("no answer here") is None
    assert final_answer("Answer: 82-15\n") == "82-15" and final_answer("Answer: 42.") == "42"
    assert prompt_ids(TOK, "Answer: 7")[0] == TOK.bos_id


def test_unknown_task_or_split_is_named():
    with pytest.raises(ValueError, match="tasks are"):
        problem("poetry", "eval", 0)
    with pytest.raises(ValueError, match="splits are"):
        problem("chat", "dev", 0)


def test_retrieval_drills_are_answered_facts_before_the_asked_one():
    plain = problem("retrieval", "train", 7, count, 128)
    drilled = problem("retrieval", "train", 7, count, 128, drills=3)
    facts = dict(re.findall(r"The code for (\w+) is (\d+-\d+)\.", drilled.prompt))
    drills = re.findall(r"Question: What is the code for (\w+)\?\nAnswer: (\d+-\d+)\n", drilled.prompt)
    assert len(drills) == 3 and all(facts[k] == v for k, v in drills)
    asked = re.findall(r"Question: What is the code for (\w+)\?\n$", drilled.prompt)[0]
    assert asked not in dict(drills) and drilled.answer == facts[asked]  # its answer stays far back
    for i in range(10):  # as many as asked for, up to half the other facts: never all (the one left would be the
        every = problem("retrieval", "train", i, count, 128, drills=1000)  # answer by elimination)
        n_facts = len(re.findall(r"The code for (\w+) is", every.prompt))
        n_drills = len(re.findall(r"\nAnswer: ", every.prompt))
        assert n_drills == (n_facts - 1) // 2
    assert "Answer:" not in plain.prompt  # none unless asked: held-out problems stay as they were


def test_retrieval_farther_than_its_keys_reach_is_named():
    with pytest.raises(ValueError, match="too far"):
        problem("retrieval", "eval", 0, count, 100_000)


def test_retrieval_keys_and_code_parts_are_whole_tiny_tokens():
    p = problem("retrieval", "eval", 2, count, 128)
    key = re.search(r"What is the code for (\d+)\?", p.prompt).group(1)
    fact = f"The code for {key} is {p.answer}.\n"
    pieces = [TOK.decode([i]) for i in TOK.encode(fact, add_bos=False)]
    a, b = p.answer.split("-")
    assert [x for x in pieces if any(c.isdigit() for c in x) or x == "-"] == [key, a, "-", b]  # no number split


def test_retrieval_past_ninety_facts_takes_longer_keys():
    p = problem("retrieval", "eval", 0, count, 1500)
    keys = re.findall(r"The code for (\d+) is", p.prompt)
    assert len(keys) > 90 and len(set(keys)) == len(keys) and any(int(k) >= 100 for k in keys)


def test_retrieval_counted_by_line_is_the_problem_counted_joined(monkeypatch):
    """The per-line token counts find the same facts as counting the joined text after each (the fallback)."""
    from dsserve.train import tasks

    def cases():
        return [
            problem("retrieval", split, i, c, back, drills=d)
            for split, n in (("train", 12), ("eval", 2))
            for i in range(n)
            for c, back, d in ((count, 416, 0), (count, 128, 30), (None, 128, 0))
        ]

    fast = cases()

    def joined(lines, line_tokens, count_tokens, min_back):
        return [i for i in range(len(lines)) if count_tokens("".join(lines[i + 1 :])) >= min_back]

    monkeypatch.setattr(tasks, "_facts_by_line_counts", lambda *a: (None, None))
    monkeypatch.setattr(tasks, "_far_facts", joined)
    assert fast == cases()
