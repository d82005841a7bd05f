"""AgentX validity (agentx.md 1.3): more than 1% context-overflow responses make a run invalid."""

from dsserve.bench import metrics as M

S = 10**9
OVERFLOW = "HTTP 400: the prompt has 9000 tokens; this model allows at most 8191 prompt tokens (max_model_len 8192)"


def _records(n: int, overflows: int, other_errors: int = 0) -> list[dict]:
    out = []
    for i in range(n):
        err = OVERFLOW if i < overflows else ("HTTP 503: busy" if i < overflows + other_errors else None)
        out.append(
            dict(phase="profile", error=err, start_ns=i * S, end_ns=i * S + 1000 * S, ttft=0.1, e2el=1.0, isl=10, osl=9)
        )
    return out


def test_context_overflow_is_told_from_other_errors():
    assert M.is_context_overflow({"error": OVERFLOW})
    assert M.is_context_overflow({"error": "This model's maximum context length is 8192 tokens."})
    assert not M.is_context_overflow({"error": "HTTP 503: busy"})
    assert not M.is_context_overflow({"error": None})
    assert M.is_context_overflow({"error": None, "context_overflow": True})  # the client's own flag wins


def test_one_percent_of_overflows_is_valid_more_is_not():
    at = M.aggregate(_records(200, 2))["validity"]  # exactly 1%: allowed
    assert at["context_overflow_rate"] == 0.01 and at["context_overflow_ok"] and at["valid"]
    over = M.aggregate(_records(200, 3))["validity"]  # 1.5%: invalid, though errors stay under 10%
    assert over["context_overflow_rate"] == 0.015 and over["error_rate_ok"]
    assert not over["context_overflow_ok"] and not over["valid"]


def test_other_errors_do_not_count_as_overflows():
    v = M.aggregate(_records(200, 0, other_errors=10))["validity"]  # 5% errors, none of them overflows
    assert v["context_overflow_rate"] == 0 and v["context_overflow_ok"] and v["valid"]
