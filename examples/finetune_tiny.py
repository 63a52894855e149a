"""Fine-tune a tiny random Kimi K3 on the shipped text with transformers.Trainer, on CPU.

    python examples/finetune_tiny.py                          # full fine-tune, 40 steps
    python examples/finetune_tiny.py --lora --output out/lora # LoRA (attention, MLPs, routed experts), save + merge
    python examples/finetune_tiny.py --balancing              # + Quantile Balancing of the router bias
    python examples/finetune_tiny.py --packing                # paragraphs packed with DataCollatorWithFlattening
    python examples/finetune_tiny.py --bf16 --gradient-checkpointing
    python examples/finetune_tiny.py --report                 # the figures of docs/training.md

`--model DIR` uses an existing model folder (e.g. one written by `kimik3 tiny DIR`); without it a tiny model is
written to a temporary folder first. Everything loads through `AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`, as a user of the Hub checkpoint would.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

from kimik3.training.data import ascii_encode, blocks, documents, load_text
from kimik3.training.memory import ActivationMeter
from kimik3.training.quantile_balancing import ExpertLoadCallback, QuantileBalancingCallback


DATA = Path(__file__).resolve().parent / "data" / "rivers.txt"


def tiny_model_dir() -> str:
    from kimik3.remote_code import save_with_code
    from kimik3.tiny import build_tiny_model

    directory = Path(tempfile.mkdtemp(prefix="kimik3-tiny-")) / "model"
    save_with_code(build_tiny_model(seed=0), directory)
    return str(directory)


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32)


def train(model_dir, steps=40, lora=False, balancing=False, packing=False, bf16=False, checkpointing=False,
          lr=None, output=None, seed=0, quiet=False):
    torch.manual_seed(seed)
    model = load(model_dir)
    text = load_text(DATA)
    if packing:
        train_dataset = documents(text, max_len=192)  # one example per paragraph
        collator = DataCollatorWithFlattening(return_tensors="pt")
        batch_size = 4  # four paragraphs per packed row
    else:
        train_dataset = blocks(ascii_encode(text), 64, stride=32)
        collator = None
        batch_size = 8
    if lora:
        from peft import get_peft_model

        from kimik3.training.lora import default_lora_config

        model = get_peft_model(model, default_lora_config(model, r=8))
        if not quiet:
            model.print_trainable_parameters()
    load_log = ExpertLoadCallback()
    callbacks = [load_log] + ([QuantileBalancingCallback()] if balancing else [])
    args = TrainingArguments(
        output_dir=output or tempfile.mkdtemp(),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=lr or (2e-2 if lora else 3e-3),
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        gradient_checkpointing=checkpointing,
        disable_tqdm=True,
        seed=seed,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collator,
                      callbacks=callbacks)
    if quiet:
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "loss_first": sum(logged[:5]) / len(logged[:5]),  # mean of steps 1-5
        "loss_last": sum(logged[-5:]) / len(logged[-5:]),
        "imbalance_first5": sum(load_log.imbalance[:5]) / len(load_log.imbalance[:5]),
        "imbalance_last10": sum(load_log.imbalance[-10:]) / len(load_log.imbalance[-10:]),
    }
    if output:
        trainer.save_model(output)  # a LoRA run saves the adapter only
        if lora:
            merged = model.merge_and_unload()
            merged.save_pretrained(Path(output) / "merged")
    return result, model


def activation_bytes(model_dir, lora=False, checkpointing=False, bf16=False, batch=8, seq_len=64):
    """Bytes kept for backward by one training forward (kimik3.training.memory.ActivationMeter)."""
    torch.manual_seed(0)
    model = load(model_dir).train()
    if lora:
        from peft import get_peft_model

        from kimik3.training.lora import default_lora_config

        model = get_peft_model(model, default_lora_config(model, r=8))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = ascii_encode(load_text(DATA))
    reps = -(-batch * seq_len // len(ids)) + 1
    ids = torch.tensor((ids * reps)[: batch * seq_len]).view(batch, seq_len)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with ActivationMeter(model) as meter:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return meter


def report(model_dir):
    print("## Activation memory (bytes saved for backward, one forward)\n")
    print("| tokens | setup | no checkpointing | checkpointing | ratio |")
    print("|---|---|---|---|---|")
    for batch, seq_len in ((8, 64), (1, 1024)):
        for label, kw in (("full f32", {}), ("full bf16 autocast", {"bf16": True}), ("LoRA r=8 f32", {"lora": True})):
            off = activation_bytes(model_dir, batch=batch, seq_len=seq_len, **kw)
            on = activation_bytes(model_dir, batch=batch, seq_len=seq_len, checkpointing=True, **kw)
            print(f"| {batch} x {seq_len} | {label} | {off.total_bytes / 2**20:.2f} MiB | "
                  f"{on.total_bytes / 2**20:.2f} MiB (inputs {on.checkpoint_input_bytes / 2**20:.2f}) | "
                  f"{on.total_bytes / off.total_bytes:.3f} |")
    print("\n## Fine-tunes (40 steps, batch 8 x 64 tokens unless packed)\n")
    print("| run | loss steps 1-5 | loss steps 36-40 | load imbalance steps 1-5 | load imbalance last 10 steps |")
    print("|---|---|---|---|---|")
    runs = (
        ("full f32", {}),
        ("full bf16 autocast", {"bf16": True}),
        ("full f32 + checkpointing", {"checkpointing": True}),
        ("full f32 + Quantile Balancing", {"balancing": True}),
        ("LoRA r=8 (lr 2e-2)", {"lora": True}),
        ("full f32, packed paragraphs", {"packing": True}),
    )
    for label, kw in runs:
        r, _ = train(model_dir, quiet=True, **kw)
        print(f"| {label} | {r['loss_first']:.3f} | {r['loss_last']:.3f} | {r['imbalance_first5']:.2f} | "
              f"{r['imbalance_last10']:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: write a tiny random model first)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--balancing", action="store_true", help="Quantile Balancing of the router bias")
    parser.add_argument("--packing", action="store_true", help="pack paragraphs with DataCollatorWithFlattening")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay f32)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--output", help="save the model (LoRA: the adapter, plus the merged model in merged/)")
    parser.add_argument("--report", action="store_true", help="print the measurements of docs/training.md")
    args = parser.parse_args()
    model_dir = args.model or tiny_model_dir()
    if args.report:
        report(model_dir)
        return
    result, _ = train(model_dir, steps=args.steps, lora=args.lora, balancing=args.balancing, packing=args.packing,
                      bf16=args.bf16, checkpointing=args.gradient_checkpointing, lr=args.lr, output=args.output)
    print(f"loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}; expert load imbalance (max/mean) "
          f"{result['imbalance_first5']:.2f} (first 5 steps) -> {result['imbalance_last10']:.2f} (last 10 steps)")


if __name__ == "__main__":
    main()
