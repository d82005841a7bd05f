"""``dsserve eval``: the harness end to end on the built-in model (not its accuracy), and its scoring."""

import json

from dsserve.bench.eval import run_mode, standard_error
from dsserve.cli import main
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.tasks import problem, prompt_ids

TOK = Tokenizer.for_preset("tiny")


def test_scoring_and_hit_mode_send_the_context_first():
    sent = []
    solved = {
        tuple(prompt_ids(TOK, p.prompt)): p.completion
        for p in (
            problem(t, "eval", i, lambda s: len(TOK.encode(s, add_bos=False)), 64)
            for t in ("arithmetic", "retrieval", "chat")
            for i in range(2)
        )
    }

    def oracle(requests):  # answers every problem right, after recording what was sent
        sent.append([ids for ids, _ in requests])
        return [solved.get(tuple(ids), "Answer: none") for ids, _ in requests]

    res = run_mode(oracle, TOK, ["arithmetic", "retrieval", "chat"], 2, hit=True, min_back=64, batch=2)
    assert all(r["accuracy"] == 1.0 and r["n"] == 2 for r in res.values())
    assert len(sent) == 6  # per task, the problems' contexts together, then their prompts
    first, second = (problem("arithmetic", "eval", i, lambda s: len(TOK.encode(s, add_bos=False)), 64) for i in (0, 1))
    assert sent[0] == [prompt_ids(TOK, first.context), prompt_ids(TOK, second.context)]
    assert sent[1] == [prompt_ids(TOK, first.prompt), prompt_ids(TOK, second.prompt)]
    wrong = run_mode(lambda r: ["Answer: x"] * len(r), TOK, ["retrieval"], 3, hit=False, min_back=64, batch=2)
    assert wrong["retrieval"]["accuracy"] == 0.0 and wrong["retrieval"]["n"] == 3
    assert abs(standard_error(30, 100) - (0.3 * 0.7 / 100) ** 0.5) < 1e-12


def test_dsserve_eval_end_to_end(tmp_path, capsys):
    assert main(["eval", "-n", "2", "--out", str(tmp_path)]) == 0  # no --model: the built-in trained checkpoint
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["model"] == "tiny-trained"
    assert last["results"] == saved["results"]
    modes = {(r["replay"], r["cache"]) for r in saved["results"]}
    assert modes == {("off", "cold"), ("off", "hit"), ("on", "cold"), ("on", "hit")}
    for r in saved["results"]:
        assert set(r["tasks"]) >= {"arithmetic", "retrieval", "chat"}
        assert all(
            t["n"] == 2 and 0.0 <= t["accuracy"] <= 1.0
            for k, t in r["tasks"].items()
            if k in ("arithmetic", "retrieval", "chat")
        )
        if r["cache"] == "hit":
            assert r["tasks"]["prefix_hit_tokens"] > 0
    assert set(saved["replay_difference_se"]) == {
        f"{c}/{t}" for c in ("cold", "hit") for t in ("arithmetic", "retrieval", "chat")
    }


def test_bad_task_is_named():
    import pytest

    with pytest.raises(SystemExit, match="tasks are"):
        main(["eval", "--model", "tiny", "--tasks", "poetry"])
    with pytest.raises(SystemExit, match="--replay takes off and/or on"):  # before any mode runs
        main(["eval", "--model", "tiny", "--replay", "off,sometimes"])
    with pytest.raises(SystemExit, match="-n and --batch must be >= 1"):
        main(["eval", "--model", "tiny", "-n", "0"])


def test_server_completer_keeps_the_order_of_concurrent_requests():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dsserve.bench.eval import server_completer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # an OpenAI-style completion whose text names the prompt's length and max_tokens
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["temperature"] == 0
            out = json.dumps({"choices": [{"text": f"{len(body['prompt'])}/{body['max_tokens']}"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        complete = server_completer(f"http://127.0.0.1:{server.server_address[1]}/", concurrency=4)
        assert complete([([1] * n, n + 1) for n in range(1, 11)]) == [f"{n}/{n + 1}" for n in range(1, 11)]
    finally:
        server.shutdown()


def _run(tmp_path, name, *args):
    out = tmp_path / name
    assert main(["eval", "--model", "tiny", "--batch", "2", "--out", str(out), *args]) == 0
    return json.loads((out / "eval.json").read_text())


def test_runs_split_by_mode_task_and_range_merge_into_one(tmp_path, capsys):
    from dsserve.bench.eval import merge

    whole = _run(tmp_path, "whole", "-n", "3", "--tasks", "retrieval", "--replay", "on", "--cache", "hit")
    assert whole["complete"] and whole["first"] == 0
    head = _run(tmp_path, "head", "-n", "2", "--tasks", "retrieval", "--replay", "on", "--cache", "hit")
    tail = _run(tmp_path, "tail", "-n", "1", "--first", "2", "--tasks", "retrieval", "--replay", "on", "--cache", "hit")
    chat = _run(tmp_path, "chat", "-n", "1", "--tasks", "chat", "--replay", "on", "--cache", "hit")
    joined = merge([tail, head, chat])
    assert joined["merged"] == 3 and joined["complete"]
    (mode,) = joined["results"]
    assert (mode["replay"], mode["cache"]) == ("on", "hit") and set(mode["tasks"]) == {
        "retrieval",
        "chat",
        "prefix_hit_tokens",
    }
    got, want = mode["tasks"]["retrieval"], whole["results"][0]["tasks"]["retrieval"]
    assert got == want and (got["n"], got["first"], got["end"]) == (3, 0, 3)  # as if run in one piece
    assert (
        mode["tasks"]["prefix_hit_tokens"]
        == sum(s["results"][0]["tasks"]["prefix_hit_tokens"] for s in (head, tail, chat))
        > 0
    )
    import pytest

    with pytest.raises(SystemExit, match="scored the same held-out problems"):
        merge([head, whole])
    with pytest.raises(SystemExit, match="differ in"):
        merge([head, {**tail, "min_back": tail["min_back"] + 1}])
    # the command line joins directories, and prints the joined table's JSON last
    capsys.readouterr()
    assert main(["eval", "--merge", str(tmp_path / "head"), str(tmp_path / "tail"), "--out", str(tmp_path / "m")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["results"][0]["tasks"]["retrieval"]["n"] == 3
    assert json.loads((tmp_path / "m" / "eval.json").read_text()) == printed


def test_an_unfinished_run_keeps_what_it_scored(tmp_path):
    from dsserve.bench.eval import run_mode

    seen = []
    partial = {}
    res = run_mode(
        lambda r: ["Answer: x"] * len(r),
        TOK,
        ["chat"],
        5,
        hit=False,
        min_back=64,
        batch=2,
        out=partial,
        on_batch=lambda: seen.append(dict(partial["chat"])),
        first=7,
    )
    assert [s["n"] for s in seen] == [2, 4, 5] and [s["end"] for s in seen] == [9, 11, 12]
    assert res["chat"]["first"] == 7 and res["chat"]["accuracy"] == 0.0
