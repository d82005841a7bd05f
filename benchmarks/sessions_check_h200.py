"""Issue 9 diagnosis: agent-like sessions at 24-30K tokens on the release proxy, offline, with a wait for the device
after every step.

32 sessions share a 24,300-token prefix, each with a suffix of its own. They run as prefix hits (bounded replay),
32 at a time, through async decode graphs and decoder-rows graphs. A finished turn comes back as the next turn:
its prompt and output plus 200-2000 new tokens. After every step the script checks:
* the logits are finite (run it with DSSERVE_CHECK_STEPS=<file>, which raises on the first bad step);
* the split-K tile counters are all zero;
* after each step with a decoder-rows graph, the weights' byte sums are unchanged.
Writes $OUT/diag-<variant>.json: the counts, the first failure, the last 40 steps, and the steps that captured.

    DSSERVE_CHECK_STEPS=$OUT/steps.json python benchmarks/sessions_check_h200.py default 210   # seconds of steps
    DIAG_TINY=1 OUT=/tmp python benchmarks/sessions_check_h200.py default 10                  # CPU smoke run
DIAG_FINGERPRINT=0 skips the weights' byte sums (slow); DIAG_BURST=1 runs the first session's prefill before the
others arrive, so they come as prefix hits together (bigger mixed steps). With DSSERVE_POISON_GRAPH_SCRATCH=1 every
graph's free pool memory is filled with NaN bytes before each replay (dsserve/engine/graph_scratch.py);
DSSERVE_GRAPH_POOL=shared puts the graphs in one pool.
"""

import json
import logging
import os
import random
import sys
import time

import torch

from dsserve.bench.provenance import run_meta
from dsserve.engine.args import EngineArgs
from dsserve.engine.core import EngineCore
from dsserve.engine.sampling_params import SamplingParams
from dsserve.kernels import split_k

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the captures' pool sizes
variant, budget = sys.argv[1], float(sys.argv[2])  # variant: a label for the output file

t_start = time.time()
TINY = os.environ.get("DIAG_TINY")
core = (
    EngineCore(
        EngineArgs(
            model="tiny",
            device="cpu",
            attention_backend="paged",
            async_scheduling=True,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            kv_cache_memory=64 << 20,
        )
    )
    if TINY
    else EngineCore(
        EngineArgs(
            model="proxy-h200-release",
            load_format="dummy",
            dtype="bfloat16",
            quantization="fp8",
            expert_format="mxfp4",
            engram_tables="host-fp8",
            max_num_seqs=32,
            max_model_len=40000,
            max_num_batched_tokens=8192,
            kv_cache_memory=8 << 30,
        )
    )
)
print(f"[{variant}] engine up in {time.time() - t_start:.1f}s", flush=True)
rng = random.Random(0)
tok = lambda n: [rng.randrange(100, 8000 if TINY else 100000) for _ in range(n)]  # noqa: E731
base = tok(300 if TINY else 24300)
sessions = {}  # id -> prompt so far
nreq = 0


def submit(sid, prompt):
    global nreq
    nreq += 1
    sessions[sid] = prompt
    n_out = rng.randint(3, 30) if TINY else rng.randint(30, 300)
    core.add_request(f"{sid}:{nreq}", prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))


submit(0, base + tok(rng.randint(10, 150) if TINY else rng.randint(100, 1500)))
if os.environ.get("DIAG_BURST") == "1":  # the prefix cached first: the others arrive together as hits
    while not core.step():
        pass
for sid in range(1, 32):
    submit(sid, base + tok(rng.randint(10, 150) if TINY else rng.randint(100, 1500)))
dg, rg = core.runner.decode_graphs, core.runner.decoder_row_graphs
net = core.model
tensors = [t for t in list(net.parameters()) + list(net.buffers()) if t.is_cuda]
for m in net.modules():
    pk = getattr(m, "packed", None)
    if pk is not None:
        tensors += [t for t in (pk.w1, pk.w3, pk.w2, pk.s1, pk.s3, pk.s2) if t is not None and t.is_cuda]


def fingerprint():
    if TINY or os.environ.get("DIAG_FINGERPRINT") == "0":
        return None
    return torch.stack([t.detach().reshape(-1).view(torch.uint8).sum(dtype=torch.int64) for t in tensors]).cpu()


fp0 = fingerprint()
print("fingerprinted", len(tensors), "weight tensors", flush=True)
last_rg = 0
log, steps, t0, bad = [], 0, time.time(), None
prev_captured = 0
while time.time() - t0 < budget:
    try:
        outs = core.step()
    except Exception as e:  # StepCheckError and friends
        bad = f"{type(e).__name__}: {e}"
        break
    torch.cuda.synchronize() if not TINY else None
    steps += 1
    nz = {str(k[2]): int((v != 0).sum()) for k, v in split_k._COUNTERS.items()}
    cap = core.graph_capture.captured if core.graph_capture else 0
    entry = {
        "step": steps,
        "t": round(time.time() - t0, 2),
        "decode": dg and dg.last_key,
        "replay": rg and rg.last_key,
        "captured": cap,
        "nonzero_counters": {k: v for k, v in nz.items() if v},
    }
    if cap != prev_captured:
        entry["new_captures"] = cap - prev_captured
        prev_captured = cap
    log.append(entry)
    if rg is not None and rg.runs != last_rg:
        last_rg = rg.runs
        fp = fingerprint()
        if fp is not None and not torch.equal(fp, fp0):
            changed = (fp != fp0).nonzero().flatten().tolist()
            entry["weights_changed"] = changed[:20]
            print("WEIGHTS CHANGED", entry, flush=True)
    if entry["nonzero_counters"]:
        print("NONZERO COUNTERS", entry, flush=True)
    for o in outs:
        if o.finished:
            sid = int(o.request_id.split(":")[0])
            more = rng.randint(20, 200) if TINY else rng.randint(200, 2000)
            nxt = sessions[sid] + list(o.outputs[0].token_ids) + tok(more)
            if len(nxt) + 300 < 40000:
                submit(sid, nxt)
    if not core.has_unfinished_requests():
        break
res = {
    "meta": run_meta(),
    "variant": variant,
    "steps": steps,
    "seconds": round(time.time() - t0, 1),
    "failure": bad,
    "requests": nreq,
    "captures": prev_captured,
    "decode_graphs": dg.report() if dg else None,
    "counters": {str(k): (tuple(v.shape), int((v != 0).sum())) for k, v in split_k._COUNTERS.items()},
    "stats": {k: v for k, v in vars(core.stats).items() if isinstance(v, (int, float))},
    "last": log[-40:],
    "capture_steps": [e for e in log if "new_captures" in e],
}
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/diag-{variant}.json", "w"), indent=1, default=str)
print(
    json.dumps(
        {k: res[k] for k in ("variant", "steps", "seconds", "failure", "requests", "captures", "counters")}, default=str
    )
)
print("last steps:", *[json.dumps(e, default=str) for e in log[-12:]], sep="\n")
