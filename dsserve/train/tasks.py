"""The synthetic tasks a built-in model is trained and evaluated on (issue 10), generated from seeds.

- ``arithmetic``: a word problem of 2-4 steps (gains, losses, doublings) with a worked solution;
- ``retrieval``: many "the code for K is V" facts (K a number 10-99, past 90 facts 100-999; V two numbers 10-99
  joined by a dash: each part one token of the tiny vocabulary, so the lookup is of whole tokens; a window-only
  model's chance is 1 in 8100), then a question about one of the facts placed at least ``min_back`` tokens before
  it (which one varies; ``retrieval_distance``: past the layers' stacked windows, so a window-only model cannot see
  it: only the global KV and the indexer can answer);
- ``chat``: a multi-turn DeepSeek-V4 chat (``server.chat.encode_chat``) whose assistant looks a value up with a
  tool call; the tool's result arrives in the next turn and the reply states it.

Every completion ends in a final line ``Answer: X``. A problem belongs to the ``train`` or the ``eval`` split by a
hash of its prompt (one in ``EVAL_SHARE`` is eval), so no seed of one split can produce a problem of the other:
held-out problems are never seen in training. ``context`` is the part of the prompt a later turn would find in the
prefix cache (the facts; the chat's earlier turns): ``prompt`` starts with it.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable

TASKS = ("arithmetic", "retrieval", "chat")
SPLITS = ("train", "eval")
EVAL_SHARE = 16  # one problem in 16 (by prompt hash) is held out
ANSWER = re.compile(r"Answer:\s*(-?\w+(?:[.-]\w+)*)")

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia")
_ITEMS = ("apples", "marbles", "coins", "books", "shells", "stamps", "cards", "pens", "beads", "tickets")
KEYS = range(10, 100)  # retrieval's keys and code parts: two-digit numbers, one token each in the tiny vocabulary
MORE_KEYS = range(100, 1000)  # keys past the 90th fact (a distance beyond ~1000 tiny tokens)
_PLACES = ("north", "south", "east", "west", "harbor", "valley", "river", "hill")


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str  # what the model is given
    completion: str  # the target continuation, ending in "Answer: X"
    answer: str
    context: str  # the prompt's prefix a later turn would find cached


def final_answer(text: str) -> str | None:
    """The X of the first ``Answer: X`` line of a generated completion (what follows may be a next question the model
    went on to invent), or None."""
    found = ANSWER.search(text)
    return found.group(1) if found else None


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a problem's text as training and evaluation both feed it: BOS first (once: a chat prompt's text
    already starts with the BOS string, which a DeepSeek vocabulary holds as one token)."""
    from ..server.chat import BOS

    return tokenizer.encode(text, add_bos=not (text.startswith(BOS) and tokenizer.token_to_id(BOS) is not None))


def retrieval_distance(cfg) -> int:
    """The default distance (tokens) from the asked fact to the question: past what windows alone can carry. Each
    layer's window reaches W rows back, so L layers stacked reach L x W: one window more than that, and at least the
    four windows the issue asks for."""
    return max(4, cfg.num_hidden_layers + 1) * cfg.sliding_window


def split_of(prompt: str) -> str:
    return "eval" if int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % EVAL_SHARE == 0 else "train"


def problem(
    task: str,
    split: str,
    index: int,
    count_tokens: Callable[[str], int] | None = None,
    min_back: int = 512,
    drills: int = 0,
) -> Problem:
    """Problem ``index`` of ``split`` for ``task`` (deterministic). ``count_tokens`` and ``min_back``: retrieval's
    distance from the asked fact to the question, in the model's tokens (default: a character count / 4).
    ``drills`` (retrieval, training): up to that many questions about other facts (at most half of them), answered,
    before the asked one: practice at every distance in one sequence (the held-out problems have none)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks are {list(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}")
    rng = random.Random(f"{task}/{split}/{index}")
    make = {"arithmetic": _arithmetic, "retrieval": _retrieval, "chat": _chat}[task]
    extra = {"drills": drills} if task == "retrieval" and drills else {}
    while True:  # draw until the problem hashes into the asked split
        p = make(rng, count_tokens or (lambda s: len(s) // 4), min_back, **extra)
        if split_of(p.prompt) == split:
            return p


def _word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution, answer) of a 2-4 step problem."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    n = rng.randint(2, 40)
    text, steps = [f"{name} has {n} {item}."], []
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice(("gain", "gain", "lose", "double"))
        if kind == "lose" and n < 2:
            kind = "gain"
        if kind == "gain":
            k = rng.randint(1, 30)
            text.append(rng.choice((f"Then {name} finds {k} more.", f"A friend gives {name} {k} more.")))
            steps.append(f"{n} + {k} = {n + k}")
            n += k
        elif kind == "lose":
            k = rng.randint(1, n - 1)
            text.append(rng.choice((f"Then {name} gives away {k}.", f"{name} loses {k} of them.")))
            steps.append(f"{n} - {k} = {n - k}")
            n -= k
        else:
            text.append(f"Then the number of {item} doubles.")
            steps.append(f"{n} * 2 = {n * 2}")
            n *= 2
    question = "Question: " + " ".join(text) + f" How many {item} does {name} have now?\nSolution:"
    return question, " " + ". ".join(steps) + f".\nAnswer: {n}\n", n


def _arithmetic(rng: random.Random, count_tokens, min_back) -> Problem:
    """A worked problem (the earlier turn, cached on a hit), then the one to solve."""
    q0, s0, _ = _word_problem(rng)
    q, sol, n = _word_problem(rng)
    context = q0 + s0 + "\n"
    return Problem("arithmetic", context + q, sol, str(n), context)


def _retrieval(rng: random.Random, count_tokens, min_back, drills: int = 0) -> Problem:
    keys = rng.sample(KEYS, len(KEYS))
    keys += rng.sample(MORE_KEYS, len(MORE_KEYS)) if count_tokens("The code for 10 is 10-10.\n") * 90 < min_back else []
    # facts until the first lies min_back + extra tokens back (extra up to half of min_back): any fact at least
    # min_back back may be the asked one, so where it sits varies and "the first fact's code" is no answer
    extra = rng.randint(0, min_back // 2)
    drawn = rng.getstate()
    facts, lines = _facts_by_line_counts(rng, keys, count_tokens, min_back + extra)
    if facts is None:  # the lines' token counts do not add up: count the joined text at every step
        rng.setstate(drawn)
        facts, lines = _facts_by_joined_counts(rng, keys, count_tokens, min_back + extra)
    far = _far_facts(lines, [_line_tokens(count_tokens, *f) for f in facts], count_tokens, min_back)
    asked = rng.choice(far)
    context = "".join(lines)
    # answered questions about other facts (practice), at most half of them: were every other fact drilled, the one
    # never asked would be the answer without a lookup; never the asked one, whose answer would then sit close by
    others = [f for i, f in enumerate(facts) if i != asked]
    for k, v in rng.sample(others, min(drills, len(others) // 2)) if drills else ():
        context += f"Question: What is the code for {k}?\nAnswer: {v}\n"
    key, value = facts[asked]
    prompt = context + f"Question: What is the code for {key}?\n"
    return Problem("retrieval", prompt, f"Answer: {value}\n", value, context)


# Counting the joined facts after every new one re-tokenizes them all (quadratic, and 16 draws per held-out problem):
# where a line's token count does not depend on its neighbours (a tokenizer that never merges across the newline or
# the space before "is") the counts add up, so a sum of cached per-part counts finds the same fact; the boundary is
# checked on the joined text, and the joined count at every step stays the fallback: either way the same problem.
@functools.lru_cache(maxsize=1 << 16)
def _part_tokens(count_tokens, text: str) -> int:
    return count_tokens(text)


def _line_tokens(count_tokens, key: str, value: str) -> int:  # the parts repeat across lines and problems
    return _part_tokens(count_tokens, f"The code for {key}") + _part_tokens(count_tokens, f" is {value}.\n")


def _fact(rng: random.Random, key) -> tuple[tuple[str, str], str]:
    value = f"{rng.choice(KEYS)}-{rng.choice(KEYS)}"
    return (str(key), value), f"The code for {key} is {value}.\n"


def _facts_by_line_counts(rng, keys, count_tokens, reach):
    """Facts until lines[1:] reach ``reach`` tokens, by a sum of per-line counts; None where the joined text says
    otherwise at the boundary."""
    facts, lines, behind = [], [], 0  # behind: tokens of lines[1:]
    while len(facts) < len(keys):
        fact, line = _fact(rng, keys[len(facts)])
        facts.append(fact)
        lines.append(line)
        behind += _line_tokens(count_tokens, *fact) if len(lines) > 1 else 0
        if len(facts) > 1 and behind >= reach:
            exact = count_tokens("".join(lines[1:])) >= reach and (
                len(lines) == 2 or count_tokens("".join(lines[1:-1])) < reach
            )
            return (facts, lines) if exact else (None, None)
    return None, None  # out of keys: the joined count raises with the numbers


def _facts_by_joined_counts(rng, keys, count_tokens, reach):
    facts, lines = [], []
    while True:
        if len(facts) == len(keys):
            raise ValueError(
                f"retrieval distance {reach} tokens is too far: {len(keys)} facts span "
                f"{count_tokens(''.join(lines))} tokens"
            )
        fact, line = _fact(rng, keys[len(facts)])
        facts.append(fact)
        lines.append(line)
        if len(facts) > 1 and count_tokens("".join(lines[1:])) >= reach:
            return facts, lines


def _far_facts(lines: list[str], line_tokens: list[int], count_tokens, min_back: int) -> list[int]:
    """Indices of the facts with at least ``min_back`` tokens after them (``line_tokens``: each line's, summed)."""
    after, behind = [], 0
    for n in reversed(line_tokens):
        after.append(behind)
        behind += n
    after.reverse()
    m = sum(a >= min_back for a in after)  # the sums shrink with i: facts 0..m-1
    if (m == 0 or count_tokens("".join(lines[m:])) >= min_back) and (
        m == len(lines) or count_tokens("".join(lines[m + 1 :])) < min_back
    ):
        return list(range(m))
    return [i for i in range(len(lines)) if count_tokens("".join(lines[i + 1 :])) >= min_back]


# The one tool of the chat task (OpenAI's function-tool form): the built-in model was trained to call it.
STOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "stock",
        "description": "How many of an item a warehouse holds",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "string"}, "warehouse": {"type": "string"}},
            "required": ["item", "warehouse"],
        },
    },
}


def _chat(rng: random.Random, count_tokens, min_back) -> Problem:
    from ..server.chat import encode_chat

    tool = STOCK_TOOL
    msgs, context, turns = [], "", rng.randint(2, 3)
    for turn in range(turns):
        item, place, n = rng.choice(_ITEMS), rng.choice(_PLACES), rng.randint(0, 500)
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "stock", "arguments": f'{{"item": "{item}", "warehouse": "{place}"}}'},
        }
        msgs += [
            {"role": "user", "content": f"How many {item} are in the {place} warehouse?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f'{{"count": {n}}}'},
        ]
        reply = f"The {place} warehouse has {n} {item}.\nAnswer: {n}"
        if turn < turns - 1:  # an earlier exchange, answered: what a later turn finds cached
            msgs.append({"role": "assistant", "content": reply})
            context = encode_chat(msgs, tools=[tool], add_generation_prompt=False)
    prompt = encode_chat(msgs, tools=[tool])
    return Problem("chat", prompt, reply + "\n", str(n), context if prompt.startswith(context) else "")
