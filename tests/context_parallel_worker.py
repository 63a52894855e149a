"""Helper for tests/test_context_parallel.py, run by torchrun on 2 CPU processes (gloo; NCCL with
KIMIK3_PARALLEL_DEVICE=cuda): context-parallel prefill and training of the tiny model, and FSDP2 training with
gradient checkpointing and Quantile Balancing. Writes per rank OUT/rank<r>.json and OUT/rank<r>.safetensors.

    torchrun --standalone --nproc-per-node 2 tests/context_parallel_worker.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

from kimik3.modeling.context_parallel_kimi_k3 import ContextParallel
from kimik3.tiny import build_tiny_model
from kimik3.training import enable_checkpointing
from kimik3.training import QuantileBalancer
from kimik3.training.fsdp import shard_model


ON_CUDA = os.environ.get("KIMIK3_PARALLEL_DEVICE") == "cuda"
# context parallelism: f32 on CPU (tight tolerance), bf16 with the f32 islands on GPU (as deployed)
CP_DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
# Prefill lengths: two to show the exchanged bytes do not grow with the length (the second not a multiple of the
# KDA chunk), and one whose second segment (2 tokens) is shorter than the conv window (3).
PREFILL_LENGTHS = (24, 37, 5)
TRAIN_LENGTH = 20
FSDP_BATCH, FSDP_LENGTH, FSDP_STEPS, FSDP_LR = 4, 12, 3, 0.05
SEED = 0


def token_ids(batch: int, length: int, seed: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def shifted_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The next token of every position (-100 at the end): shifted before the sequence is split, so a segment's
    last label is the next rank's first token."""
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: int) -> torch.Tensor:
    """Sum of the token losses over `num_targets` (the whole sequence's count): the ranks' losses add up to the
    single-process mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum") / num_targets


def cache_tensors(cache, prefix: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for idx, layer in enumerate(cache.layers):
        if layer.is_linear:
            tensors[f"{prefix}.{idx}.state"] = layer.recurrent_state
            for name, conv in zip("qkv", layer.conv_states):
                tensors[f"{prefix}.{idx}.conv_{name}"] = conv
        else:
            tensors[f"{prefix}.{idx}.latents"] = layer.latents
    return tensors


def context_parallel_prefill(model, device, tensors: dict, report: dict) -> None:
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    vocab = model.config.vocab_size
    for length in PREFILL_LENGTHS:
        input_ids = token_ids(2, length, length, vocab).to(device)
        cp = ContextParallel.for_sequence(length)
        cache = KimiK3Cache(model.config)
        with torch.no_grad():
            logits = model(input_ids=cp.shard(input_ids), cache=cache, use_cache=True, context_parallel=cp).logits
        tensors[f"prefill{length}.logits"] = logits
        tensors.update(cache_tensors(cache, f"prefill{length}.cache"))
        report[f"prefill{length}"] = {"lengths": list(cp.lengths), "seen_tokens": cache.get_seq_length(),
                                      "exchanged_bytes": {str(k): v for k, v in sorted(cp.exchanged_bytes.items())}}


def context_parallel_training(model, device, tensors: dict) -> None:
    """Forward and backward of this rank's segment (gradient checkpointing on: the exchanges run again in the
    recompute); the parameter gradients summed over the ranks."""
    model.train()
    enable_checkpointing(model, use_reentrant=False)
    input_ids = token_ids(2, TRAIN_LENGTH, 1, model.config.vocab_size).to(device)
    cp = ContextParallel.for_sequence(TRAIN_LENGTH)
    logits = model(input_ids=cp.shard(input_ids), use_cache=False, context_parallel=cp).logits
    labels = shifted_labels(input_ids)
    next_token_loss(logits, cp.shard(labels), int((labels != -100).sum())).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.detach().clone()
            dist.all_reduce(grad)
            tensors[f"grad.{name}"] = grad
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    model.zero_grad(set_to_none=True)
    model.eval()


def fsdp_training(device, rank: int, world_size: int, tensors: dict, report: dict) -> None:
    """FSDP2 + gradient checkpointing + Quantile Balancing; each rank trains on its share of the global batch."""
    model = build_tiny_model(seed=SEED).to(device).train()
    balancer = QuantileBalancer(model)
    shard_model(model, gradient_checkpointing=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=FSDP_LR)
    per_rank = FSDP_BATCH // world_size
    losses = []
    for step in range(FSDP_STEPS):
        batch = token_ids(FSDP_BATCH, FSDP_LENGTH, 100 + step, model.config.vocab_size).to(device)
        local = batch[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=local, labels=local, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / world_size)
    report["fsdp_losses"] = losses
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            tensors[f"fsdp.{name}"] = buffer.detach().clone()


def as_released_dtypes(model, dtype: torch.dtype):
    """The model in `dtype` with the release's f32 islands kept f32 (`_keep_in_fp32_modules_strict`)."""
    model = model.to(dtype)
    islands = ("A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm")
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in islands:
            module.float()
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in islands:
            param.data = param.data.float()
    return model


def fsdp_bf16_groups(device, report: dict) -> None:
    """A bf16 model with its f32 islands: the islands get their own FSDP2 groups and keep their dtype."""
    model = as_released_dtypes(build_tiny_model(seed=SEED).to(device), torch.bfloat16)
    shard_model(model.train())
    input_ids = token_ids(2, 8, 7, model.config.vocab_size).to(device)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    report["bf16_fsdp"] = {
        "loss_finite": bool(torch.isfinite(loss)),
        "f32_params": sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32),
        "grads_finite": all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters()
                            if p.grad is not None),
    }


def run_all(out_dir: Path) -> None:
    """Every check, in an initialised process group; writes this rank's report and tensors to OUT_DIR."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}" if ON_CUDA else "cpu")
    tensors, report = {}, {}
    if ON_CUDA:  # the FSDP loss curve is compared in f32: no TF32 convolutions
        torch.backends.cudnn.allow_tf32 = False
    model = as_released_dtypes(build_tiny_model(seed=SEED).to(device), CP_DTYPE)
    context_parallel_prefill(model, device, tensors, report)
    context_parallel_training(model, device, tensors)
    fsdp_training(device, rank, world_size, tensors, report)
    fsdp_bf16_groups(device, report)
    dist.barrier()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              str(Path(out_dir) / f"rank{rank}.safetensors"))


def main(argv: list[str]) -> None:
    dist.init_process_group("nccl" if ON_CUDA else "gloo")
    if ON_CUDA:
        torch.cuda.set_device(dist.get_rank())
    try:
        run_all(Path(argv[0]))
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    main(sys.argv[1:])
