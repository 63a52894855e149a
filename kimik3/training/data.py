# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Small-data helpers for demos and tests: the shipped text, an ASCII byte "tokenizer", fixed-length blocks and
documents for packing.

The tiny models (`kimik3 tiny`, vocab 128) read ASCII codes directly as token ids, so no tokenizer file is needed;
a real checkpoint uses its own tokenizer and `datasets` as usual.
"""

from __future__ import annotations

from pathlib import Path

import torch


def shipped_text_path() -> Path:
    """`examples/data/rivers.txt` of a source checkout (an original few-KB essay shipped with the project)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "rivers.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the example text ships with the source tree (pip install -e), not the wheel"
        )
    return path


def load_text(path: str | Path | None = None) -> str:
    return Path(path or shipped_text_path()).read_text(encoding="utf-8")


def ascii_encode(text: str, vocab_size: int = 128) -> list[int]:
    """Token ids = ASCII codes (the tiny models reserve 0 pad, 1 bos, 2 eos, which text does not use)."""
    ids = list(text.encode("ascii"))
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"code {max(ids)} does not fit vocab_size={vocab_size}")
    return ids


def ascii_decode(ids) -> str:
    return bytes(int(i) for i in ids if 32 <= int(i) < 128 or int(i) == 10).decode("ascii")


def blocks(ids: list[int], seq_len: int, stride: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Fixed-length causal-LM examples (`input_ids` = `labels`, the model shifts) cut from one token stream."""
    stride = stride or seq_len
    return [
        {"input_ids": torch.tensor(ids[i : i + seq_len]), "labels": torch.tensor(ids[i : i + seq_len])}
        for i in range(0, len(ids) - seq_len + 1, stride)
    ]


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def documents(text: str, max_len: int | None = None, vocab_size: int = 128) -> list[dict[str, list[int]]]:
    """One example per paragraph (`{"input_ids": [...]}`, optionally truncated) for
    `transformers.DataCollatorWithFlattening`, which packs them into one row with restarting `position_ids`."""
    docs = []
    for para in paragraphs(text):
        ids = ascii_encode(para, vocab_size)
        docs.append({"input_ids": ids[:max_len] if max_len else ids})
    return docs


__all__ = ["ascii_decode", "ascii_encode", "blocks", "documents", "load_text", "paragraphs", "shipped_text_path"]
