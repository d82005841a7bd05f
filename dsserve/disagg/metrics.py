"""P/D hand-off metrics of one instance, in the engine's Prometheus registry (``server.metrics.EngineMetrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TRANSFER_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    """A decode instance's loads (bytes moved by kind, against the window-carrying alternative; transfer and replay
    seconds) and a prefill instance's hand-offs."""

    def __init__(self, registry, model_name: str):
        m = [model_name]
        self.bytes = Counter(
            "dsserve:kv_transfer_bytes",
            "Bytes of prompt KV a decode instance pulled, by kind (global: main and index entries; window: exact "
            "mode's window rows) and what two window-carrying alternatives would have moved instead: "
            "with_window_rows (every layer's window row of every token), with_window_ring (the last W rows a layer).",
            ["model_name", "kind"],
            registry=registry,
        )
        self.loads = Counter(
            "dsserve:kv_transfer_loads", "Remote-KV loads by outcome.", ["model_name", "outcome"], registry=registry
        )
        self.handoffs = Counter(
            "dsserve:kv_handoffs",
            "Requests a prefill instance handed off (prompt KV staged).",
            ["model_name"],
            registry=registry,
        ).labels(*m)
        self.transfer_s = Histogram(
            "dsserve:kv_transfer_seconds",
            "A load's pull, from its start to its blocks in the cache.",
            ["model_name"],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        ).labels(*m)
        self.replay_s = Histogram(
            "dsserve:kv_replay_seconds",
            "A loaded request's admission to its first token: the bounded replay of its last prompt rows.",
            ["model_name"],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        ).labels(*m)
        self.model_name = model_name
        for kind in ("global", "window", "with_window_rows", "with_window_ring"):
            self.bytes.labels(model_name, kind)
        for outcome in ("ok", "failed"):
            self.loads.labels(model_name, outcome)

    def observe(self, out) -> None:
        """A finished ``RequestOutput``."""
        if out.kv_transfer_params is not None:
            self.handoffs.inc()
        st = out.kv_transfer_stats
        if not st:
            return
        m = self.model_name
        self.loads.labels(m, "ok").inc()
        self.bytes.labels(m, "global").inc(st.get("global_bytes", 0))
        self.bytes.labels(m, "window").inc(st.get("bytes", 0) - st.get("global_bytes", 0))
        self.bytes.labels(m, "with_window_rows").inc(st.get("with_window_rows_bytes", 0))
        self.bytes.labels(m, "with_window_ring").inc(st.get("with_window_ring_bytes", 0))
        if "transfer_s" in st:
            self.transfer_s.observe(st["transfer_s"])
        if "replay_s" in st:
            self.replay_s.observe(st["replay_s"])

    def failed(self) -> None:
        self.loads.labels(self.model_name, "failed").inc()
