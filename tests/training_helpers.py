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
