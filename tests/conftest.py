import os

import pytest
import torch

# Two cores in CI: one intra-op thread avoids oversubscription when pytest and torch both want them.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models():
    """Seeded random tiny models in fp64 (QAT on), built once per session: {"tiny": model, "tiny-v4": model}."""
    from dsserve.models.checkpoint import dummy_weights
    from dsserve.models.model import DeepseekForCausalLM
    from dsserve.models.presets import preset

    out = {}
    for name in ("tiny", "tiny-v4"):
        cfg = preset(name)
        m = DeepseekForCausalLM(cfg).eval()
        dummy_weights(m, cfg, seed=0)
        out[name] = m.double()
    return out
