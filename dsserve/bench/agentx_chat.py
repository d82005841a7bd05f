"""OpenAI chat message arrays for ``dsserve bench agentx --api chat`` (spec agentx.md §3.3 "Request shape").

Each conversation grows turn by turn: [system (the conversation's shared prefix), user, assistant (the trace's
output of the previous turn), tool | user (the appended input), ...]; a compacted turn restarts from
[system, user]. Every piece's text is made from the trace's token ids, each mapped to a "safe" word of the local
tokenizer (``" word"`` that encodes to one token, so text round-trips), so the same ids give the same text and
earlier messages are reused verbatim (a real shared prefix on the server). The new messages' contents are then
padded / trimmed word by word until ``len(chat_prompt_ids(tokenizer, messages))`` equals the target exactly
(``chat_prompt_ids`` is the server's own chat encoding). An append too short for a chat turn's framing (EOS, role
headers, ``<tool_result>`` tags) becomes a user turn, else extends the last message (earlier ones stay verbatim);
when the target still cannot be reached the closest is kept (``chat_token_mismatch``).
"""

from __future__ import annotations

from dsserve.models.tokenizer import Tokenizer
from dsserve.server.chat import chat_prompt_ids


def safe_words(tok) -> list[str]:
    """``" word"`` strings (ASCII letters) that the tokenizer encodes as exactly one token, in id order."""
    out = []
    for i in range(tok.vocab_size):
        s = tok.decode([i])
        if len(s) > 1 and s[0] == " " and s[1:].isascii() and s[1:].isalpha() and len(tok.encode(s, False)) == 1:
            out.append(s)
    if not out:
        raise ValueError(f"tokenizer {getattr(tok, 'name', '')!r} has no single-token ' word' strings")
    return out


def scaled_len(n: int, k: int, block: int = 64) -> int:
    """Tokens kept of an ``n``-token prompt when each ``block``-token block keeps its first ``k``."""
    return (n // block) * k + min(k, n % block)


def mismatches(records) -> int:
    """Chat requests whose locally encoded prompt missed the trace's ISL (closest kept)."""
    return sum(r["chat_isl"] != r["isl_target"] for r in records if "isl_target" in r)


class ChatBuilder:
    """Message arrays with an exact chat-encoded prompt length, per (play, request), parents built on demand."""

    def __init__(self, tokenizer, max_iters: int = 8):
        self.tok = Tokenizer.load(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.words, self.max_iters, self.cache = safe_words(self.tok), max_iters, {}

    def text(self, ids) -> list[str]:
        w = self.words
        return [w[int(i) % len(w)] for i in ids]

    def count(self, msgs) -> int:
        return len(chat_prompt_ids(self.tok, msgs))

    def fit(self, head: list, new: list, target: int, keep: int = 1) -> tuple[list, int]:
        """``head`` + ``new`` (role, words) messages; pad/trim the last new message (then, when trimming, earlier
        new ones; the last keeps ``keep`` words) until the encoded length is ``target``. Returns (messages, length)."""
        words = [list(w) for _, w in new]
        words[-1] = words[-1] or [self.words[0]]
        filler = (self.words[(7 * j + 3) % len(self.words)] for j in range(1 << 30))
        best = None
        for _ in range(self.max_iters):
            msgs = head + [{"role": r, "content": "".join(w)} for (r, _), w in zip(new, words)]
            n = self.count(msgs)
            if best is None or abs(n - target) < abs(best[1] - target):
                best = (msgs, n)
            if n == target:
                break
            if n < target:
                words[-1] += [next(filler) for _ in range(target - n)]
                continue
            drop = n - target
            for j, w in reversed(list(enumerate(words))):  # the last keeps a word (empty tags tokenise apart)
                cut = min(drop, len(w) - (keep if j == len(words) - 1 else 0))
                del w[len(w) - cut :]
                drop -= cut
            if drop == n - target:  # nothing left to trim
                break
        return best

    def build(self, trace, sess, r, ids_of, k: int, salt: str, block: int = 64) -> tuple[list, int, int]:
        """Messages for request ``r`` of ``sess`` whose encoding has ``len(ids_of(r))`` tokens (``ids_of``: the
        request's (scaled) trace ids). Returns (messages, target, encoded length)."""
        key = (salt, sess.index, r.idx)
        if key in self.cache:
            return self.cache.pop(key)
        ids = ids_of(r)
        target = len(ids)
        par = sess.requests[r.parent] if r.parent is not None else None
        if par is None or r.compacted:
            p = min(scaled_len(r.sys_blocks * block, k, block), target)
            head = [{"role": "system", "content": "".join(self.text(ids[:p]))}] if p else []
            out = self.fit(head, [("user", self.text(ids[p:]))], target)
        else:
            head, _, _ = self.build(trace, sess, par, ids_of, k, salt, block)
            pt = min(len(ids), scaled_len(par.isl, k, block))
            n_out = min(max(1, round(par.osl * k / block)) if k < block else par.osl, len(ids) - pt)
            role = "tool" if r.input_type == "tool_result" else "user"
            new = [("assistant", self.text(ids[pt : pt + n_out])), (role, self.text(ids[pt + n_out :]))]
            out = self.fit(list(head), new, target)
            if out[1] != target and role == "tool":  # an append too short for <tool_result> tags: a user turn
                out = min(
                    out, self.fit(list(head), [new[0], ("user", new[1][1])], target), key=lambda o: abs(o[1] - target)
                )
            if out[1] > target and head:  # an append shorter than a chat turn: extend the last message instead
                last = [" " + w for w in head[-1]["content"].split()]
                ext = self.fit(head[:-1], [(head[-1]["role"], last + new[0][1] + new[1][1])], target, len(last))
                out = min(out, ext, key=lambda o: abs(o[1] - target))
        res = (out[0], target, out[1])
        self.cache[key] = res  # the next turn of the conversation (built before or after this one) pops it
        if len(self.cache) > 4096:
            self.cache.pop(next(iter(self.cache)))
        return res
