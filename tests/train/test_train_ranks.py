"""Data-parallel training (issue 10): two gloo ranks, each on its share of a step's problems, sum to the gradients
of one process on the whole batch."""

import os

import torch
import torch.multiprocessing as mp

from dsserve.models.checkpoint import dummy_weights
from dsserve.models.model import DeepseekForCausalLM
from dsserve.models.presets import preset
from dsserve.models.tokenizer import Tokenizer
from dsserve.train.ranks import Ranks
from dsserve.train.train import TrainConfig, backward_step, batch_of

CFG = TrainConfig(batch=4, min_back=32, prompt_weight=0.5, mix=(("arithmetic", 0.5), ("retrieval", 0.5)))


def _grads(step: int) -> dict[str, torch.Tensor]:
    cfg = preset("tiny")
    model = DeepseekForCausalLM(cfg)
    dummy_weights(model, cfg, seed=0)
    model.double().train()  # float64: two ranks' sequences attend in batches of another size than one rank's
    tokenizer = Tokenizer.for_preset("tiny")
    backward_step(
        model, CFG, batch_of(CFG, step, tokenizer, CFG.min_back), False, Ranks(), {"pad_id": tokenizer.eos_id}
    )
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    grads = _grads(3)
    if rank == 0:
        torch.save(grads, out)
    torch.distributed.destroy_process_group()


def test_two_ranks_sum_to_the_whole_batch(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "grads.pt")
    mp.spawn(_rank, args=(2, port, out), nprocs=2, join=True)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    whole, ranked = _grads(3), torch.load(out)
    assert whole.keys() == ranked.keys() and len(whole) > 50
    for name, g in whole.items():
        assert torch.allclose(ranked[name], g, rtol=1e-9, atol=1e-9 * float(g.abs().max()) + 1e-15), name
