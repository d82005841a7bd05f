import json
import os
import subprocess
import sys

from dsserve.cli import main
from dsserve.models.presets import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_info_tiny(capsys):
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "layer roles" in out and "reindex" in out and "cand. source" in out
    assert "23,608,782" in out and "49,796" in out


def test_info_v41_flash_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "dsserve", "info", "v41-flash"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "layer roles" in r.stdout and "890 B" in r.stdout and "551.88 B" in r.stdout
    assert "384,006,168" in r.stdout
    assert all(f"│ {i:>5} │" in r.stdout for i in range(40))


def test_info_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny-v4").to_hf_dict()))
    assert main(["info", str(tmp_path)]) == 0
    assert "hash-routed" in capsys.readouterr().out


def test_unknown_model_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "dsserve", "info", "no-such-model"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2
    assert "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_no_command_exit_2(capsys):
    assert main([]) == 2


def test_generate_on_the_default_model_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "dsserve", "generate", "--prompt", "Hello", "--max-tokens", "6"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and len(r.stdout.strip()) > len("Hello")
    assert "6 generated tokens" in r.stderr
    assert "random weights" not in r.stderr  # the default is the built-in trained checkpoint


def test_generate_bad_input_is_a_clear_error(capsys):
    assert main(["generate", "--model", "tiny", "--max-tokens", "0"]) == 2
    assert "max_tokens=0" in capsys.readouterr().err


def test_bench_forward_prints_a_table_and_a_json_line():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsserve",
            "bench",
            "forward",
            "--batch",
            "2",
            "--context",
            "40",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "bench forward" in r.stdout and "attention" in r.stdout
    last = json.loads(r.stdout.strip().splitlines()[-1])
    res = last["results"][0]
    assert last["bench"] == "forward" and res["context"] == 40 and res["new_tokens"] == 3 and res["seconds"] > 0
    assert {"encoder", "decoder", "attention", "moe", "indexer", "sampler"} <= set(res["stages"])


def test_serve_with_no_model_serves_the_built_in_checkpoint():
    import argparse

    from dsserve.engine.args import EngineArgs
    from dsserve.server.serve import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    ns = p.parse_args([])
    assert ns.served_model is None and EngineArgs.from_cli(ns).model == "tiny-trained"


def test_plan_v41_flash_on_one_gpu_does_not_fit_and_says_by_how_much(capsys):
    assert main(["plan", "--model", "v41-flash", "--gpus", "1", "--gpu-memory", "141GiB"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit" in out and "exceed the budget 126.90 GiB (0.9 x 141 GiB) by 181.32 GiB" in out
    assert "--enable-expert-parallel" in out


def test_plan_v41_flash_dep8_fits_with_kv_tokens_per_gpu(capsys):
    argv = ["plan", "--model", "v41-flash", "--gpus", "8", "--enable-expert-parallel", "--data-parallel-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits: 91,941,530 KV tokens per GPU" in out and "890 B/token" in out
