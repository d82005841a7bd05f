"""CPU cost of the output parser per token: a thinking-mode reply (reasoning, content, two tool calls with a long
string argument) tokenized by the tiny vocabulary and fed one token's text at a time, as the server does.

    python benchmarks/parser_cost_cpu.py --out benchmarks/results/parser-cost-cpu
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import time

from dsserve.models.tokenizer import Tokenizer
from dsserve.parsers import OutputParser

D = "｜DSML｜"


def sample_output(repeat: int) -> str:
    reasoning = "The user wants the weather in two cities, so I call the tool twice and then compare. " * repeat
    body = 'A long argument with <tags>, "quotes" and newlines\n' * repeat
    call = lambda city: (  # noqa: E731
        f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">{city}</{D}parameter>\n'
        f'<{D}parameter name="note" string="true">{body}</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>'
    )
    content = "Let me look both up. " * repeat
    return f"{reasoning}</think>\n\n{content}\n\n<{D}tool_calls>\n{call('Paris')}\n{call('Rome')}\n</{D}tool_calls>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=40, help="scales the reply's length")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="write result.json here")
    a = ap.parse_args()
    tok = Tokenizer.for_preset("tiny")
    text = sample_output(a.repeat)
    enc = tok.tok.encode(text, add_special_tokens=False)
    ids = enc.ids
    # one text delta per token, as a detokenizer gives them (a token inside a multi-byte character gives "")
    pieces, prev = [], 0
    for _, end in enc.offsets:
        pieces.append(text[prev:end])
        prev = max(prev, end)
    assert "".join(pieces) == text
    best = {}
    for label, feed, drop in (("per-token", pieces, False), ("per-token-drop", pieces, True), ("whole", [text], False)):
        times = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            p = OutputParser("v4", thinking=True, tools=["get_weather"], drop_malformed=drop)
            for piece in feed:
                p.feed(piece)
            out = p.finish("eos")
            times.append(time.perf_counter() - t0)
        assert len(out.tool_calls) == 2
        best[label] = min(times)
    result = {
        "command": "python benchmarks/parser_cost_cpu.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items() if v),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}), 1 thread, Python {platform.python_version()}",
        "tokens": len(ids),
        "chars": len(text),
        "feeds_per_token_mode": len(pieces),
        "us_per_token_streamed": 1e6 * best["per-token"] / len(ids),
        "us_per_token_streamed_drop_malformed": 1e6 * best["per-token-drop"] / len(ids),  # the server's setting
        "us_per_token_whole": 1e6 * best["whole"] / len(ids),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
