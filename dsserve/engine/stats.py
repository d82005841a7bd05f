"""What the engine counts: prefix-cache queries and hits, replayed rows, and what bounded replay saves."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..kv.paged import KVLayout
from ..models.accounting import layer_parts
from ..models.config import ModelConfig
from .scheduler import StepPlan


@dataclass
class EngineStats:
    layout: KVLayout
    cfg: ModelConfig
    prefix_query_tokens: int = 0  # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0  # of those, whose global KV came from the prefix cache
    replayed_rows: int = 0  # rows run again through the encoder to rebuild windows after a hit
    prefill_rows: int = 0
    decoder_rows_skipped: int = 0  # prefill rows that did not run the decoder (decoder-side replay)
    graph_steps: int = 0  # decode steps run in fixed shapes (replayed CUDA graphs on a GPU)
    replay_graph_steps: int = 0  # steps whose decoder rows ran in fixed shapes after bounded replay's narrowing
    encoder_graph_steps: int = 0  # replayed steps whose encoder rows ran in fixed shapes (engine.encoder_graphs)
    verify_graph_steps: int = 0  # speculative steps run in fixed shapes (engine.verify_graphs)
    propose_graph_steps: int = 0  # draft proposals run in fixed shapes (engine.propose_graphs)
    graph_captures: int = 0  # CUDA graphs captured (each stalls its step once: 0.2-1.6 s on the release proxy)
    graph_capture_seconds: float = 0.0  # the time those steps waited for their captures
    graph_pool_bytes: int = 0  # device memory their pools reserved (one shared pool: engine.graph_capture)
    triton_compiles: int = 0  # Triton kernels compiled by this process since the start or the warm-up; each
    triton_compile_seconds: float = 0.0  # stalled its step (engine.jit_compiles)
    triton_cache_loads: int = 0  # kernels loaded from Triton's disk cache instead (a few ms each)
    ahead_steps: int = 0  # decode steps launched before the host read the previous step's tokens (async)
    nonfinite_logit_rows: int = 0  # sampled rows whose logits had a NaN or inf: a fault, 0 in a sound run
    # speculative decoding (engine.drafter), vLLM's counters: verify blocks, drafts in them, drafts accepted, and
    # accepted drafts by position in the block (position i counts blocks whose first i + 1 drafts were accepted)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list = field(default_factory=list)
    steps: int = 0
    # A step's wall time split at its one copy back of the sampled tokens: host work (scheduling, launching or
    # refilling and replaying, sampling's launches, detokenising, stop checks) and the wait for the device there.
    step_host_seconds: float = 0.0
    step_wait_seconds: float = 0.0

    def counters(self) -> dict:
        """The monotone counts by field name (a copy: what a DP rank sends its front end each step)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("layout", "cfg")}
        out["spec_accepted_per_pos"] = list(self.spec_accepted_per_pos)
        return out

    def step_done(self, host_s: float, wait_s: float) -> None:
        self.steps += 1
        self.step_host_seconds += host_s
        self.step_wait_seconds += wait_s

    def admitted(self, plan: StepPlan) -> None:
        for c in plan.chunks:
            r = c.request
            if r.counted_admission != r.num_preemptions:  # first step of this admission
                r.counted_admission = r.num_preemptions
                self.prefix_query_tokens += r.num_tokens
                self.prefix_hit_tokens += r.num_cached_tokens
                self.replayed_rows += max(0, min(r.num_cached_tokens, r.num_tokens) - r.num_computed_tokens)
            if not c.samples or c.num_tokens - c.num_drafts > 1:
                self.prefill_rows += c.num_tokens - c.num_drafts

    def spec_counted(self, drafted: int, accepted: int) -> None:
        """One verified block: ``drafted`` drafts, of which the first ``accepted`` were accepted."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += drafted
        self.spec_num_accepted_tokens += accepted
        if len(self.spec_accepted_per_pos) < drafted:
            self.spec_accepted_per_pos += [0] * (drafted - len(self.spec_accepted_per_pos))
        for i in range(accepted):
            self.spec_accepted_per_pos[i] += 1

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verify block gave on average: 1 (the target's own) + accepted drafts (vLLM's definition)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def decoder_flops_saved(self) -> float:
        """2 x active decoder parameters per skipped row (attention over the window is small next to it)."""
        per_row = sum(
            v
            for r in self.cfg.roles
            if r.side == "decoder"
            for k, v in layer_parts(self.cfg, r).items()
            if k != "routed_experts"
        )
        return 2.0 * per_row * self.decoder_rows_skipped

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0,
            "replayed_rows": self.replayed_rows,
            "prefill_rows": self.prefill_rows,
            "decoder_rows_skipped": self.decoder_rows_skipped,
            "decoder_flops_saved": self.decoder_flops_saved,
            "graph_steps": self.graph_steps,
            "replay_graph_steps": self.replay_graph_steps,
            "encoder_graph_steps": self.encoder_graph_steps,
            "verify_graph_steps": self.verify_graph_steps,
            "propose_graph_steps": self.propose_graph_steps,
            "graph_captures": self.graph_captures,
            "graph_capture_seconds": self.graph_capture_seconds,
            "graph_pool_bytes": self.graph_pool_bytes,
            "triton_compiles": self.triton_compiles,
            "triton_compile_seconds": self.triton_compile_seconds,
            "triton_cache_loads": self.triton_cache_loads,
            "ahead_steps": self.ahead_steps,
            "nonfinite_logit_rows": self.nonfinite_logit_rows,
            "spec_num_drafts": self.spec_num_drafts,
            "spec_num_draft_tokens": self.spec_num_draft_tokens,
            "spec_num_accepted_tokens": self.spec_num_accepted_tokens,
            "spec_accepted_per_pos": list(self.spec_accepted_per_pos),
            "spec_mean_acceptance_length": self.spec_mean_acceptance_length,
            "steps": self.steps,
            "step_host_seconds": self.step_host_seconds,
            "step_wait_seconds": self.step_wait_seconds,
            **persistent_bytes(lay),
        }


def persistent_bytes(lay: KVLayout) -> dict:
    """Bytes the prefix cache keeps per token, by kind, with and without the window rows."""
    per_kind = {"main": 0.0, "index": 0.0}
    for ratio, _ in lay.sources.values():
        per_kind["main"] += lay.main_fmt.row_bytes / ratio
        if lay.index_fmt is not None:
            per_kind["index"] += lay.index_fmt.row_bytes / ratio
    without = lay.persistent_bytes_per_token(with_window=False)
    with_w = lay.persistent_bytes_per_token(with_window=True)
    return {
        "cached_bytes_per_token_main": per_kind["main"],
        "cached_bytes_per_token_index": per_kind["index"],
        "window_bytes_per_token": lay.window_bytes_per_token,
        "persistent_bytes_per_token": without,
        "persistent_bytes_per_token_with_window": with_w,
        "window_cost_ratio": with_w / without,
    }
