"""Activation (gradient) checkpointing under the names the installed transformers uses.

transformers 5.23 renamed `TrainingArguments(gradient_checkpointing=...)` and `model.gradient_checkpointing_enable()`
to `activation_checkpointing*`; the old names still work there but warn (FutureWarning), and 5.17-5.22 know only the
old ones. These two helpers pick whichever the installed version wants, so the same code is quiet on both.
"""

import dataclasses


def checkpointing_arguments(enabled: bool = True, checkpoint_kwargs: dict | None = None) -> dict:
    """Keyword arguments for `TrainingArguments`: `{"activation_checkpointing": enabled}` on transformers >= 5.23,
    `{"gradient_checkpointing": enabled}` before (plus `*_kwargs` when `checkpoint_kwargs` is given)."""
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    arguments = {name: enabled}
    if checkpoint_kwargs is not None:
        arguments[f"{name}_kwargs"] = checkpoint_kwargs
    return arguments


def enable_checkpointing(model, **checkpoint_kwargs) -> None:
    """Checkpoint every decoder layer of `model` (e.g. `use_reentrant=False`), without a deprecation warning."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or None)
