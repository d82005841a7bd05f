"""The model runner: one batched forward over a step's mixed prefill chunks and decodes, on the paged cache. It reads
the requests' progress and never moves it (``Scheduler.update`` does, after the step)."""

from __future__ import annotations

import torch

from ..layers.context import SeqRows, StepBatch
from ..models.model import DeepseekForCausalLM
from .request import Request
from .scheduler import StepPlan


class ModelRunner:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        replay_form: str = "report",
        decode_graphs=None,
        decoder_row_graphs=None,
        encoder_graphs=None,
        verify_graphs=None,
    ):
        """``decode_graphs`` (engine.decode_graphs.DecodeGraphs): plain decode steps run through it, in fixed
        shapes (CUDA graphs on a GPU); None: every step runs ``forward_batch``. ``decoder_row_graphs``
        (engine.decoder_row_graphs.DecoderRowGraphs): other steps' decoder rows after bounded replay's narrowing run
        through it; ``encoder_graphs`` (engine.encoder_graphs.EncoderGraphs): their encoder rows before it.
        ``verify_graphs`` (engine.verify_graphs.VerifyGraphs): speculative verify steps run through it."""
        self.model, self.replay_form, self.decode_graphs = model, replay_form, decode_graphs
        self.decoder_row_graphs, self.encoder_graphs = decoder_row_graphs, encoder_graphs
        self.verify_graphs = verify_graphs
        self.last_forward = None
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zeroes what this runner and its fixed-shape runners counted (the warm-up's steps are not traffic)."""
        self.decoder_rows_skipped = 0  # prefill rows bounded replay kept out of the decoder
        self.graph_steps = 0  # steps run by decode_graphs
        for g in (self.decode_graphs, self.decoder_row_graphs, self.encoder_graphs, self.verify_graphs):
            if g is not None:
                g.reset_counts()

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> tuple[list[Request], torch.Tensor]:
        """Runs the plan's rows; returns the requests that sample this step and their logits: one row each, or
        1 + k for a chunk verifying k drafts (its draft rows' and its last row's, in order). The forward's output
        (hidden rows, DSpark taps; a verify graph's: taps only) stays on ``last_forward`` until the next step."""
        self.last_forward = None
        key = None if self.decode_graphs is None else self.decode_graphs.key(plan)
        if key is not None:
            logits = self.decode_graphs.run(plan, key)
            self.graph_steps += 1
            return [c.request for c in plan.chunks], logits
        key = None if self.verify_graphs is None else self.verify_graphs.key(plan)
        if key is not None:
            logits, self.last_forward = self.verify_graphs.run(plan, key)
            return [c.request for c in plan.chunks], logits
        ids, seqs, starts, row = [], [], [], 0
        for c in plan.chunks:
            r, start = c.request, c.request.num_computed_tokens
            starts.append(start)
            ids.extend(r.token_ids(start, start + c.num_tokens - c.num_drafts))
            ids.extend(c.draft_token_ids)
            seqs.append(SeqRows(slice(row, row + c.num_tokens), r.kv, r.decoder_start))
            row += c.num_tokens
        tokens = torch.tensor(ids, dtype=torch.long)  # on the host: forward_batch checks, then moves them
        step = StepBatch(
            tokens,
            seqs,
            replay_form=self.replay_form,
            decoder_rows=self.decoder_row_graphs,
            encoder_rows=self.encoder_graphs,
        )
        out = self.last_forward = self.model.forward_batch(step)
        self.decoder_rows_skipped += len(ids) - out.hidden.shape[0]
        last_rows = [
            i
            for c, s in zip(plan.chunks, out.seqs)
            if c.samples
            for i in range(s.rows.stop - 1 - c.num_drafts, s.rows.stop)
        ]
        sampling = [c.request for c in plan.chunks if c.samples]
        logits = self.model.logits(out.hidden[last_rows]) if last_rows else torch.empty(0)
        for c, s, start in zip(plan.chunks, out.seqs, starts):
            first = start + c.num_tokens - (s.rows.stop - s.rows.start)  # the position of the chunk's first row
            if c.request.prompt_logprobs is not None and first < c.request.num_prompt_tokens - 1:
                record_prompt_logprobs(c.request, first, self.model.logits(out.hidden[s.rows]))
        return sampling, logits


def record_prompt_logprobs(r: Request, start: int, logits: torch.Tensor) -> None:
    """Row i of a chunk from ``start`` (position start + i) gives the logprob of prompt token start + i + 1: kept
    with its rank and the top ``prompt_logprobs`` on ``r.prompt_logprobs`` (by position: a recompute rewrites)."""
    n = min(logits.shape[0], r.num_prompt_tokens - 1 - start)
    lp = logits[:n].float().log_softmax(dim=-1)
    target = torch.tensor(r.prompt_token_ids[start + 1 : start + 1 + n], device=lp.device)
    chosen = lp.gather(1, target.unsqueeze(1))
    ranks = (lp >= chosen).sum(dim=-1)
    k = min(r.params.prompt_logprobs, lp.shape[1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], target[:, None][:, :0])
    rows = zip(target.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())
    for i, row in enumerate(rows):
        r.prompt_logprobs[start + 1 + i] = row
