"""Issue 9 diagnosis only (untracked): DIAG_OWN_POOLS=1 gives every CUDA graph capture its own memory pool;
DIAG_COUNTERS=1 checks after every DSSERVE_CHECK_STEPS wait that the split-K tile counters are all zero."""

import os

if os.environ.get("DIAG_OWN_POOLS") or os.environ.get("DIAG_COUNTERS"):
    import logging
    import time

    log = logging.getLogger("dsserve")
    from dsserve.engine import graph_capture, step_check
    from dsserve.kernels import split_k

    orig_call = graph_capture.GraphCapture.__call__
    own = bool(os.environ.get("DIAG_OWN_POOLS"))

    def call(self, run):
        if own:
            self.pool = None
        t0 = time.time()
        out = orig_call(self, run)
        log.warning("diag: capture %d (own pool: %s) took %.2fs", self.captured, own, time.time() - t0)
        return out

    graph_capture.GraphCapture.__call__ = call

    if os.environ.get("DIAG_COUNTERS"):
        orig_after = step_check.StepCheck.after
        seen = [0]

        def after(self, label, logits, seqs, **took):
            try:
                return orig_after(self, label, logits, seqs, **took)
            finally:
                nz = {str(k[2]): int((v != 0).sum()) for k, v in split_k._COUNTERS.items()}
                nz = {k: v for k, v in nz.items() if v}
                if nz and seen[0] < 30:
                    seen[0] += 1
                    log.warning("diag: nonzero split-K counters after a %s step %s: %s", label, took, nz)

        step_check.StepCheck.after = after
