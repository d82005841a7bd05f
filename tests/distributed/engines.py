"""How the DP front-end tests drive an engine (a ``DPClient`` or a single ``EngineCore``) and compare outputs."""

from __future__ import annotations

from dsserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)


def prompt(i: int, n: int) -> list[int]:
    """Prompt ``i`` of ``n`` tokens (deterministic, distinct for distinct ``i``)."""
    return [3 + (i * 131 + j * 17) % 7000 for j in range(n)]


def run(engine, requests: dict, params: SamplingParams = PARAMS, **kw) -> dict:
    """rid -> final RequestOutput, every request added at once."""
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params, **kw)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def same_outputs(got: dict, want: dict, tol: float) -> None:
    """The same requests, tokens and top logprob tokens; logprobs within ``tol``."""
    assert got.keys() == want.keys()
    for rid in got:
        x, y = got[rid].outputs[0], want[rid].outputs[0]
        assert x.token_ids == y.token_ids
        for p, q in zip(x.logprobs, y.logprobs):
            assert p.keys() == q.keys() and all(abs(p[t].logprob - q[t].logprob) < tol for t in p)
