"""``dsserve eval``: the harness end to end on the built-in model (not its accuracy), and its scoring."""
import json

from dsserve.bench.eval import run_mode, standard_error
from dsserve.cli import main
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.tasks import problem, prompt_ids

TOK = Tokenizer.for_preset("tiny")


def test_scoring_and_hit_mode_send_the_context_first():
    sent = []
    solved = {tuple(prompt_ids(TOK, p.prompt)): p.completion
              for p in (problem(t, "eval", i, lambda s: len(TOK.encode(s, add_bos=False)), 64)
                        for t in ("arithmetic", "retrieval", "chat") for i in range(2))}

    def oracle(ids, k):  # answers every problem right, after recording what was sent
        sent.append(ids)
        return solved.get(tuple(ids), "Answer: none")
    res = run_mode(oracle, TOK, ["arithmetic", "retrieval", "chat"], 2, hit=True, min_back=64)
    assert all(r["accuracy"] == 1.0 and r["n"] == 2 for r in res.values())
    assert len(sent) == 12  # each problem's context, then its prompt
    first = problem("arithmetic", "eval", 0, lambda s: len(TOK.encode(s, add_bos=False)), 64)
    assert sent[0] == prompt_ids(TOK, first.context) and sent[1] == prompt_ids(TOK, first.prompt)
    wrong = run_mode(lambda ids, k: "Answer: x", TOK, ["retrieval"], 3, hit=False, min_back=64)
    assert wrong["retrieval"]["accuracy"] == 0.0 and wrong["retrieval"]["n"] == 3
    assert abs(standard_error(30, 100) - (0.3 * 0.7 / 100) ** 0.5) < 1e-12


def test_dsserve_eval_end_to_end(tmp_path, capsys):
    assert main(["eval", "--model", "tiny", "-n", "1", "--out", str(tmp_path)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert last["results"] == saved["results"]
    modes = {(r["replay"], r["cache"]) for r in saved["results"]}
    assert modes == {("off", "cold"), ("off", "hit"), ("on", "cold"), ("on", "hit")}
    for r in saved["results"]:
        assert set(r["tasks"]) >= {"arithmetic", "retrieval", "chat"}
        assert all(t["n"] == 1 and 0.0 <= t["accuracy"] <= 1.0 for k, t in r["tasks"].items() if k in
                   ("arithmetic", "retrieval", "chat"))
        if r["cache"] == "hit":
            assert r["tasks"]["prefix_hit_tokens"] > 0
    assert set(saved["replay_difference_se"]) == {f"{c}/{t}" for c in ("cold", "hit")
                                                  for t in ("arithmetic", "retrieval", "chat")}


def test_bad_task_is_named():
    import pytest
    with pytest.raises(SystemExit, match="tasks are"):
        main(["eval", "--model", "tiny", "--tasks", "poetry"])
    with pytest.raises(SystemExit, match="-n must be >= 1"):
        main(["eval", "--model", "tiny", "-n", "0"])
