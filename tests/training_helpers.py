"""Shared helpers for the training tests (no tests here): the tiny remote-code model, data, a Trainer factory."""

import functools
import math
import tempfile
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from kimik3.training.data import ascii_encode, blocks, load_text


SEQ_LEN = 64


@functools.lru_cache(maxsize=None)
def tiny_model_dir(seed: int = 0) -> str:
    """A tiny random K3 (4 layers: KDA, KDA, KDA, MLA; hidden 64; 8 experts, top-2; latent MoE; AttnRes) saved with
    its remote code, once per test process."""
    from kimik3.remote_code import save_with_code
    from kimik3.tiny import build_tiny_model

    directory = Path(tempfile.mkdtemp(prefix="kimik3-tiny-")) / "model"
    save_with_code(build_tiny_model(seed=seed), directory)
    return str(directory)


def load_tiny(dtype=torch.float32, seed: int = 0):
    """`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` of the tiny model, in train mode."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(seed), trust_remote_code=True, dtype=dtype).train()


@functools.lru_cache(maxsize=None)
def text_ids() -> tuple[int, ...]:
    return tuple(ascii_encode(load_text()))


def unigram_entropy() -> float:
    """Entropy (nats/char) of the shipped text's character frequencies: the best loss without context."""
    counts = Counter(text_ids())
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def train_blocks(seq_len: int = SEQ_LEN, stride: int = 32):
    return blocks(list(text_ids()), seq_len, stride)


def batch_of(n: int = 4, seq_len: int = SEQ_LEN, offset: int = 0) -> dict:
    data = train_blocks(seq_len)[offset : offset + n]
    return {
        "input_ids": torch.stack([d["input_ids"] for d in data]),
        "labels": torch.stack([d["labels"] for d in data]),
    }


def make_trainer(model, output_dir, max_steps: int, callbacks=(), trainer_cls=Trainer, **overrides) -> Trainer:
    kwargs = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return trainer_cls(
        model=model, args=TrainingArguments(**kwargs), train_dataset=train_blocks(), callbacks=list(callbacks)
    )


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def assert_base_untouched(peft_model, before: dict) -> None:
    """Every base tensor of a PEFT model (not an adapter's, not a wrapped layer's) equals its value in `before`."""
    for key, value in peft_model.base_model.model.state_dict().items():
        if "lora_" not in key and "base_layer" not in key and key in before:
            assert torch.equal(value, before[key]), key


def expert_lora_factors(saved: dict, module: str, value: torch.Tensor, num_experts: int, rank: int):
    """(A [E, r, in], B [E, out, r]) of the adapter saved for the fused expert tensor `value` of `module` (PEFT's
    factor layout): of the two nested ParamWrappers of an experts module, the pair whose shapes fit the tensor."""
    pairs = [(saved[f"base_model.model.{module}.{p}A.weight"], saved[f"base_model.model.{module}.{p}B.weight"])
             for p in ("lora_", "base_layer.lora_")]
    a, b = next((a, b) for a, b in pairs if b.shape[0] == value.shape[1] and a.shape[1] == value.shape[2])
    return a.reshape(num_experts, rank, -1), b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)


def randomize_adapters(model, seed: int = 0) -> None:
    """LoRA B starts at zero (adapter = identity); give every factor random values so the adapter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
