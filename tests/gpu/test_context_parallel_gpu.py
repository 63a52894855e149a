"""Two GPUs, NCCL (NVLink multicast off): context-parallel prefill and training of the tiny model in bf16 (f32
islands kept) against one GPU, and FSDP2 training (f32, gradient checkpointing, Quantile Balancing) against one GPU
with the same global batch. The worker is tests/context_parallel_worker.py, as in the CPU test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


if torch.cuda.device_count() < 2:
    pytest.skip("needs at least 2 CUDA devices", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from gpu_helpers import rel_err  # noqa: E402
from kimik3.tiny import build_tiny_model  # noqa: E402
from kimik3.training import QuantileBalancer  # noqa: E402


TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

os.environ["KIMIK3_PARALLEL_DEVICE"] = "cuda"  # the worker module reads it at import: bf16 context parallelism
import context_parallel_worker as worker  # noqa: E402


DEVICE = torch.device("cuda:0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("context_parallel_gpu_out")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "KIMIK3_PARALLEL_DEVICE": "cuda", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(TESTS / "context_parallel_worker.py"), str(out_dir)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [(json.loads((out_dir / f"rank{r}.json").read_text()), load_file(str(out_dir / f"rank{r}.safetensors")))
            for r in range(2)]


@pytest.fixture(scope="module")
def bf16_model():
    return worker.as_released_dtypes(build_tiny_model(seed=worker.SEED).to(DEVICE), torch.bfloat16)


@pytest.mark.parametrize("length", worker.PREFILL_LENGTHS)
def test_context_parallel_prefill_on_two_gpus_matches_one(runs, bf16_model, length):
    input_ids = worker.token_ids(2, length, length, bf16_model.config.vocab_size).to(DEVICE)
    with torch.no_grad():
        output = bf16_model(input_ids=input_ids, use_cache=True)
    cache = output.cache if hasattr(output, "cache") else output.past_key_values
    reference = {k: v.float().cpu() for k, v in worker.cache_tensors(cache, "cache").items()}
    logits = output.logits.float().cpu()
    start = 0
    for rank, (report, tensors) in enumerate(runs):
        end = start + report[f"prefill{length}"]["lengths"][rank]
        # bf16: the zero-start pass plus the correction rounds differently from one pass
        assert rel_err(tensors[f"prefill{length}.logits"].float(), logits[:, start:end]) < 2e-2, rank
        for name, want in reference.items():
            assert rel_err(tensors[f"prefill{length}.{name}"].float(), want) < 2e-2, (rank, name)
        start = end


def test_context_parallel_training_on_two_gpus_matches_one(runs, bf16_model):
    model = worker.as_released_dtypes(build_tiny_model(seed=worker.SEED).to(DEVICE), torch.bfloat16).train()
    input_ids = worker.token_ids(2, worker.TRAIN_LENGTH, 1, model.config.vocab_size).to(DEVICE)
    labels = worker.shifted_labels(input_ids)
    worker.next_token_loss(model(input_ids=input_ids, use_cache=False).logits, labels,
                           int((labels != -100).sum())).backward()
    grads = {f"grad.{n}": p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    for rank, (_, tensors) in enumerate(runs):
        errors = {name: rel_err(tensors[name].float(), want) for name, want in grads.items()}
        assert max(errors.values()) < 5e-2, (rank, sorted(errors.items(), key=lambda kv: -kv[1])[:5])


def test_fsdp2_on_two_gpus_loss_curve_matches_one(runs):
    torch.backends.cudnn.allow_tf32 = False
    model = build_tiny_model(seed=worker.SEED).to(DEVICE).train()
    balancer = QuantileBalancer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.FSDP_LR)
    losses = []
    for step in range(worker.FSDP_STEPS):
        batch = worker.token_ids(worker.FSDP_BATCH, worker.FSDP_LENGTH, 100 + step, model.config.vocab_size)
        loss = model(input_ids=batch.to(DEVICE), labels=batch.to(DEVICE), use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
        losses.append(float(loss.detach()))
    for report, _ in runs:
        assert report["fsdp_losses"] == pytest.approx(losses, rel=1e-4)
        assert report["bf16_fsdp"]["loss_finite"] and report["bf16_fsdp"]["grads_finite"]
