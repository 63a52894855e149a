"""What a fine-tune writes next to its weights: the tokenizer and processor files of the folder it started from.

`Trainer.save_model` and `save_pretrained` write the weights, the config and (ours) the model code; a LoRA run writes
the adapter alone. Without the tokenizer `kimik3 chat OUTPUT` and `AutoTokenizer.from_pretrained(OUTPUT)` fail, and
without processor_config.json and the processor code `AutoProcessor` does. `carry_tokenizer_files` copies them from
the base folder, byte for byte: the same vocabulary the weights were trained on. Pure file copies; nothing is loaded.
"""

import fnmatch
import shutil
from pathlib import Path

# The tokenizer, chat and processor files a model folder of this project holds (kimik3 tiny, kimik3 convert), with
# the code files they name in auto_map: the release's tokenizer code here, ours the processor's PROCESSOR_CODE_FILES
# (its tokenizer's file included), read when files are carried. The model code itself is the weights' saver's business.
CARRIED_PATTERNS = (
    "tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template*", "tokenization_kimi.py", "encoding_k3.py", "processor_config.json", "preprocessor_config.json",
)


def carry_tokenizer_files(source, output) -> list[str]:
    """Copies the tokenizer and processor files of `source` (the folder the fine-tuned model was loaded from) into
    `output` (a saved model or adapter folder), leaving alone any the save already wrote. Returns the names copied;
    none when `source` has no tokenizer (a model that reads raw ids, such as the example's ASCII model)."""
    source, output = Path(source), Path(output)
    if not (source / "tokenizer_config.json").is_file():
        return []
    from kimik3.modeling.processing_kimi_k3 import PROCESSOR_CODE_FILES  # the model's code: only when copying

    patterns = CARRIED_PATTERNS + PROCESSOR_CODE_FILES
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
            target = output / path.name
            if not target.exists():
                shutil.copyfile(path, target)
                copied.append(path.name)
    return copied
