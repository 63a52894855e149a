"""Fine-tune a tiny random Kimi K3 on the shipped text with transformers.Trainer, on CPU.

    python examples/finetune_tiny.py                          # full fine-tune, 40 steps, one torch thread
    python examples/finetune_tiny.py --lora --output out/lora # LoRA (attention, MLPs, routed experts), save + merge;
                                                              # needs peft: pip install -e ".[train]"
    python examples/finetune_tiny.py --balancing              # + Quantile Balancing of the router bias
    python examples/finetune_tiny.py --packing                # paragraphs packed with DataCollatorWithFlattening
    python examples/finetune_tiny.py --bf16 --gradient-checkpointing
    python examples/finetune_tiny.py --report                 # the figures of docs/training.md

`--model DIR` uses an existing model folder (e.g. one written by `kimik3 tiny DIR`: the outputs then carry its
tokenizer and processor files, so `kimik3 chat OUTPUT/merged` and AutoTokenizer / AutoProcessor work on them);
without it a tiny model that reads ASCII codes as token ids (vocab 128, no tokenizer) is
written first (to OUTPUT/base with `--output`, so a saved LoRA adapter names a base model that still exists; else to
a temporary folder that is removed at the end). Everything loads through `AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`, as a user of the Hub checkpoint would.

The figures depend on the number of torch threads (the order of float sums changes with it), so the example fixes
it (`--threads`, default 1: on the 2-core development machine one thread was also the faster) and prints it next to
every figure.
"""

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

from kimik3.training import carry_tokenizer_files, checkpointing_arguments, enable_checkpointing
from kimik3.training.data import ascii_encode, blocks, documents, load_text
from kimik3.training.activations import ActivationMeter
from kimik3.training.quantile_balancing import ExpertLoadCallback, QuantileBalancingCallback


DATA = Path(__file__).resolve().parent / "data" / "rivers.txt"


def write_tiny_model(directory: Path) -> str:
    from kimik3.remote_code import save_with_code
    from kimik3.tiny import build_tiny_model

    save_with_code(build_tiny_model(seed=0), directory)
    return str(directory)


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ModuleNotFoundError:
        sys.exit('finetune_tiny.py: error: --lora needs peft, which is not installed: pip install -e ".[train]" '
                 '(or pip install "peft>=0.19.1")')


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
        require_peft()
        from peft import get_peft_model

        from kimik3.training.lora import default_lora_config

        model = get_peft_model(model, default_lora_config(model, r=8))
        if not quiet:
            model.print_trainable_parameters()
    load_log = ExpertLoadCallback()
    callbacks = [load_log] + ([QuantileBalancingCallback()] if balancing else [])
    with contextlib.ExitStack() as stack:
        # Trainer needs an output_dir even with save_strategy="no"; without --output it is a folder removed after
        trainer_dir = output or stack.enter_context(tempfile.TemporaryDirectory(prefix="kimik3-trainer-"))
        args = TrainingArguments(
            output_dir=trainer_dir,
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
            disable_tqdm=True,
            seed=seed,
            **checkpointing_arguments(checkpointing),
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
        "steps": len(logged),
        "loss_first": sum(logged[:5]) / len(logged[:5]),  # mean of steps 1-5
        "loss_last": sum(logged[-5:]) / len(logged[-5:]),
        "imbalance_first5": sum(load_log.imbalance[:5]) / len(load_log.imbalance[:5]),
        "imbalance_last10": sum(load_log.imbalance[-10:]) / len(load_log.imbalance[-10:]),
    }
    if output:
        trainer.save_model(output)  # a LoRA run saves the adapter only
        outputs = [Path(output)]
        if lora:
            merged = model.merge_and_unload()
            merged.save_pretrained(Path(output) / "merged")
            outputs.append(Path(output) / "merged")
        for folder in outputs:  # the base folder's tokenizer and processor (none for the ASCII model)
            carry_tokenizer_files(model_dir, folder)
    return result, model


def activation_bytes(model_dir, lora=False, checkpointing=False, bf16=False, batch=8, seq_len=64):
    """Bytes kept for backward by one training forward (kimik3.training.activations.ActivationMeter)."""
    torch.manual_seed(0)
    model = load(model_dir).train()
    if lora:
        require_peft()
        from peft import get_peft_model

        from kimik3.training.lora import default_lora_config

        model = get_peft_model(model, default_lora_config(model, r=8))
    if checkpointing:
        enable_checkpointing(model, use_reentrant=False)
    ids = ascii_encode(load_text(DATA))
    reps = -(-batch * seq_len // len(ids)) + 1
    ids = torch.tensor((ids * reps)[: batch * seq_len]).view(batch, seq_len)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with ActivationMeter(model) as meter:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return meter


def report(model_dir, steps=40):
    threads = torch.get_num_threads()
    print(f"## Activation memory (bytes saved for backward, one forward; {threads} torch thread(s))\n")
    print("| tokens | setup | no checkpointing | checkpointing | ratio |")
    print("|---|---|---|---|---|")
    for batch, seq_len in ((8, 64), (1, 1024)):
        for label, kw in (("full f32", {}), ("full bf16 autocast", {"bf16": True}), ("LoRA r=8 f32", {"lora": True})):
            off = activation_bytes(model_dir, batch=batch, seq_len=seq_len, **kw)
            on = activation_bytes(model_dir, batch=batch, seq_len=seq_len, checkpointing=True, **kw)
            print(f"| {batch} x {seq_len} | {label} | {off.total_bytes / 2**20:.2f} MiB | "
                  f"{on.total_bytes / 2**20:.2f} MiB (inputs {on.checkpoint_input_bytes / 2**20:.2f}) | "
                  f"{on.total_bytes / off.total_bytes:.3f} |")
    print(f"\n## Fine-tunes ({steps} steps, batch 8 x 64 tokens unless packed; {threads} torch thread(s))\n")
    print(f"| run | loss steps 1-5 | loss steps {steps - 4}-{steps} | load imbalance steps 1-5 | "
          "load imbalance last 10 steps |")
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
        r, _ = train(model_dir, steps=steps, quiet=True, **kw)
        print(f"| {label} | {r['loss_first']:.3f} | {r['loss_last']:.3f} | {r['imbalance_first5']:.2f} | "
              f"{r['imbalance_last10']:.2f} |")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: write a tiny random model first)")
    parser.add_argument("--steps", type=positive_int, default=40, help="optimizer steps (at least 10; default 40)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default 1: the published figures were measured with one)")
    parser.add_argument("--lr", type=float, help="learning rate (default 3e-3, LoRA 2e-2)")
    parser.add_argument("--lora", action="store_true", help='PEFT LoRA (needs peft: pip install -e ".[train]")')
    parser.add_argument("--balancing", action="store_true", help="Quantile Balancing of the router bias")
    parser.add_argument("--packing", action="store_true", help="pack paragraphs with DataCollatorWithFlattening")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (weights stay f32)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="checkpoint every decoder layer")
    parser.add_argument("--output", help="save the model (LoRA: the adapter, plus the merged model in merged/); "
                                         "without --model the tiny base model is written to OUTPUT/base")
    parser.add_argument("--report", action="store_true", help="print the measurements of docs/training.md")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error(f"argument --steps: {args.steps} is too few: the summary averages the first 5 and the last 10")
    if args.lora or args.report:
        require_peft()
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        model_dir = args.model
        if model_dir is None:
            base = Path(args.output).resolve() / "base" if args.output and not args.report else Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="kimik3-tiny-")))
            model_dir = write_tiny_model(base)
        if args.report:
            report(model_dir, args.steps)
            return
        result, _ = train(model_dir, steps=args.steps, lora=args.lora, balancing=args.balancing,
                          packing=args.packing, bf16=args.bf16, checkpointing=args.gradient_checkpointing,
                          lr=args.lr, output=args.output)
    n = result["steps"]
    print(f"{n} steps, {args.threads} torch thread(s): loss {result['loss_first']:.3f} (steps 1-5) -> "
          f"{result['loss_last']:.3f} (steps {n - 4}-{n}); expert load imbalance (max/mean) "
          f"{result['imbalance_first5']:.2f} (steps 1-5) -> {result['imbalance_last10']:.2f} (steps {n - 9}-{n})")


if __name__ == "__main__":
    main()
