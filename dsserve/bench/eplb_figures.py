"""The EPLB figures of a benchmark window, from two ``/metrics`` texts of a server run with ``--enable-eplb``
(``dsserve:eplb_*``, exported by ``server.metrics`` from the DP ranks' ``EplbReport``s): what ``dsserve bench
agentx`` and ``dsserve bench serve`` put in their JSON line and print under their table."""

from __future__ import annotations

from .agentx_warmup import _LABEL, _PROM


def _samples(text: str) -> list[tuple[str, dict, float]]:
    return [
        (m[1], dict(_LABEL.findall(m[2] or "")), float(m[3]))
        for m in _PROM.finditer(text)
        if "eplb_" in m[1] and not m[1].endswith("_created")
    ]


def eplb_figures(before: str, after: str) -> dict | None:
    """Per MoE model (``target``, ``draft``): the balance kinds at the end of the window (``balance[kind]`` =
    ``{"all": ..., "layers": [...]}``: step, window, before, before_predicted, after_predicted, after; see
    ``distributed.eplb.BALANCE_KINDS``), the rebalances and bytes moved during the window and in all, the last
    rebalance's bytes and the transfer buffer's peak and bound; ``steps_waited``: lockstep steps of the window that
    waited for a transfer chunk. None: the server exports no EPLB figures."""
    now = _samples(after)
    if not now:
        return None
    then = {(name, tuple(sorted(lab.items()))): v for name, lab, v in _samples(before)}
    out: dict = {}
    models: dict[str, dict] = {}
    for name, lab, v in now:
        base = name.split(":")[-1]
        grew = v - then.get((name, tuple(sorted(lab.items()))), 0.0)
        if base == "eplb_steps_waited_total":
            out.update(steps_waited=grew, steps_waited_total=v)
            continue
        m = models.setdefault(lab.get("model", "?"), {"balance": {}})
        if base.startswith("eplb_balance_"):
            kind = m["balance"].setdefault(base.removeprefix("eplb_balance_"), {"all": None, "layers": {}})
            if lab["layer"] == "all":
                kind["all"] = v
            else:
                kind["layers"][int(lab["layer"])] = v
        elif base == "eplb_rebalances_total":
            m.update(rebalances=grew, rebalances_total=v)
        elif base == "eplb_bytes_moved_total":
            m.update(bytes_moved=grew, bytes_moved_total=v)
        elif base == "eplb_bytes_moved_last_rebalance":
            m["bytes_moved_last_rebalance"] = v
        elif base == "eplb_transfer_buffer_bytes":
            m[f"buffer_{lab['kind']}_bytes"] = v
    for m in models.values():
        for kind in m["balance"].values():
            kind["layers"] = [kind["layers"][i] for i in sorted(kind["layers"])]
    out["models"] = dict(sorted(models.items(), key=lambda kv: kv[0] != "target"))
    return out


def eplb_lines(e: dict, prefix: str = "") -> list[str]:
    """Human lines of ``eplb_figures``' result, one a model."""
    lines = []
    for name, m in e["models"].items():
        b = m["balance"]

        def f(kind: str) -> str:
            return "-" if kind not in b or b[kind]["all"] is None else f"{b[kind]['all']:.3f}"

        worst = ""
        if "step" in b and b["step"]["layers"]:
            i = min(range(len(b["step"]["layers"])), key=b["step"]["layers"].__getitem__)
            worst = f", worst layer {i} at {b['step']['layers'][i]:.3f}"
        lines.append(
            f"{prefix}EPLB {name}: balance per step {f('step')}{worst}, over the window {f('window')}; last "
            f"rebalance: before {f('before')} (expected {f('before_predicted')}) -> expected {f('after_predicted')}, "
            f"measured after {f('after')}; rebalances {m.get('rebalances', 0):g} in the window "
            f"({m.get('rebalances_total', 0):g} in all), {m.get('bytes_moved', 0) / 1e6:,.1f} MB moved; transfer "
            f"buffer peak {m.get('buffer_peak_bytes', 0) / 1e6:,.1f} MB of {m.get('buffer_bound_bytes', 0) / 1e6:,.1f}"
        )
    if "steps_waited" in e:
        lines.append(f"{prefix}EPLB: {e['steps_waited']:g} steps waited for a transfer chunk in the window")
    return lines
