"""`kimik3 verify SRC CONVERTED`: a converted folder against its source.

1. Tensors: the converted folder is read back into the release's naming (the export direction of the name map, with
   experts split per expert and dequantised when kept packed), and every tensor is compared bit for bit with the
   source's value (MXFP4 experts dequantised), following the layer / expert slicing recorded in
   `kimik3_conversion.json`. Different code paths do the two directions (fusing vs slicing), so a mistake in either
   shows up as a mismatch. Every converted tensor must be accounted for. The source is read with the `safetensors`
   library, not with our reader, so a header our parser misreads cannot make both sides agree.
   When CONVERTED is itself in the release layout (an `export`), the two release folders are compared name by name,
   counting bytes-equal tensors apart from MXFP4 experts whose bytes differ but whose values are equal (a source
   that chose another valid E8M0 scale than the OCP rule export uses).
2. Logits: the converted folder is loaded with `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`
   and compared with the same class built from the source's values in memory (dense experts), on a short fixed
   input. Skipped for models above `max_logits_params` parameters or when the model classes are not available.
"""

import copy
import re
from pathlib import Path

import torch

from . import files, name_map as nm
from .checkpoint import Checkpoint
from .converter import open_source
from .errors import ConversionError, shard_error
from .files import PROVENANCE_NAME
from .mxfp4 import dequantize_mxfp4
from .plan import ConvertOptions, RunContext, build_convert_plan, build_export_plan, materialise
from .safetensors_io import E8M0
from .schedule import layer_map as make_layer_map

_LAYER_IN_NAME = re.compile(r"^(language_model\.)?(model\.layers\.)(\d+)(\..*)$")
_MXFP4_PARTS = (".weight_packed", ".weight_scale")


class LibraryReader:
    """Tensors of a checkpoint read with the `safetensors` library (an independent parser), one shard open at a
    time (its memory map is released when the next shard is opened)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self._shard, self._handle = None, None

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.ckpt.shard_of(name)
        path = self.ckpt.shard_path(shard)
        try:
            if shard != self._shard:
                self._handle, self._shard = None, None
                self._handle, self._shard = safe_open(str(path), "pt"), shard
            return self._handle.get_tensor(name).clone()
        except Exception as exc:  # SafetensorError, OSError, missing key: name the file, do not guess
            raise shard_error(path, f"the safetensors library cannot read it: {exc}", name) from None

    def close(self) -> None:
        self._handle, self._shard = None, None


def _source_value(src, lib: LibraryReader, release_name: str) -> torch.Tensor:
    name = release_name if src.composite else release_name.removeprefix("language_model.")
    if name in src.weight_map:
        return lib.read(name)
    if name.endswith(".weight") and name + "_packed" in src.weight_map:
        return dequantize_mxfp4(lib.read(name + "_packed"), lib.read(name + "_scale"))
    raise ConversionError(f"{src.index_path}: the source has no tensor `{name}`")


def _to_source_name(name: str, layer_map: list[int]) -> str:
    match = _LAYER_IN_NAME.match(name)
    if not match:
        return name
    prefix, body, layer, rest = match.groups()
    return f"{prefix or ''}{body}{layer_map[int(layer)]}{rest}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def compare_tensors(src, conv, layer_map: list[int]) -> dict:
    plan = build_export_plan(conv, RunContext(), experts_format="dense")
    mismatches, compared = [], 0
    lib = LibraryReader(src)
    for tensor in plan.tensors:
        release_name = tensor.spec.name
        source_name = _to_source_name(release_name, layer_map)
        expected = _source_value(src, lib, source_name)
        relative = release_name.removeprefix("language_model.")
        scope = "vision" if relative.startswith(("vision_tower.", "mm_projector.")) else "text"
        match = nm.match_release(relative, conv.text_config, scope)
        if match is not None and getattr(match.rule, "transform", None) == "first_experts":
            expected = expected[: tensor.spec.shape[0]]
        actual = materialise(tensor)
        compared += 1
        if not _same_bits(actual, expected):
            diff = (
                float((actual.float() - expected.float()).abs().max())
                if actual.shape == expected.shape
                else f"shape {list(actual.shape)} vs {list(expected.shape)}"
            )
            mismatches.append({"tensor": release_name, "source": source_name, "max_abs_diff": diff})
    lib.close()
    return {"compared": compared, "mismatches": mismatches}


def is_release_layout(ckpt) -> bool:
    text = ckpt.config_dict.get("text_config")
    return (isinstance(text, dict) and "quantization_config" in text) or any(
        ".block_sparse_moe." in name for name in ckpt.weight_map)


def _tensor_group(name: str) -> tuple[str, ...]:
    """An MXFP4 expert is compared as its (packed, scale) pair: equal values can come from different bytes."""
    for suffix in _MXFP4_PARTS:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return tuple(base + s for s in _MXFP4_PARTS)
    return (name,)


def compare_release_layouts(src, other) -> dict:
    """Two release-layout folders (a source and its export), name by name: bytes-equal tensors, MXFP4 pairs whose
    bytes differ but whose dequantised values are equal, and mismatches (missing names included)."""
    lib = LibraryReader(src)
    mismatches, bytes_equal, values_equal, done = [], 0, 0, set()
    for name in sorted(set(src.weight_map) | set(other.weight_map)):
        if name in done:
            continue
        group = _tensor_group(name)
        done.update(group)
        absent = [n for n in group if n not in src.weight_map or n not in other.weight_map]
        if absent:
            side = "source" if absent[0] not in src.weight_map else "exported folder"
            mismatches.append({"tensor": absent[0], "source": absent[0], "max_abs_diff": f"missing in the {side}"})
            continue
        want = [lib.read(n) for n in group]
        got = [other.reader(n).read(n, E8M0 if n.endswith("_scale") else None) for n in group]
        if all(_same_bits(a, b) for a, b in zip(got, want)):
            bytes_equal += len(group)
        elif len(group) == 2 and all(a.shape == b.shape for a, b in zip(got, want)) and torch.equal(
                dequantize_mxfp4(*got, torch.float32), dequantize_mxfp4(*want, torch.float32)):
            values_equal += len(group)
        else:
            diff = (float((got[0].float() - want[0].float()).abs().max()) if got[0].shape == want[0].shape
                    else f"shape {list(got[0].shape)} vs {list(want[0].shape)}")
            mismatches.append({"tensor": name, "source": name, "max_abs_diff": diff})
    lib.close()
    return {"compared": len(done), "bytes_equal": bytes_equal, "values_equal_bytes_differ": values_equal,
            "mismatches": mismatches}


def _reference_state(src, provenance: dict) -> dict:
    options = provenance.get("options", {})
    plan = build_convert_plan(src, ConvertOptions(
        text_only=options.get("text_only", False),
        experts_format="dense",
        num_layers=options.get("num_layers"),
        num_experts=options.get("num_experts"),
        allow_unknown=options.get("allow_unknown", False),
    ))
    return {t.spec.name: materialise(t) for t in plan.tensors}


def compare_logits(src, converted: Path, provenance: dict, num_tokens: int) -> dict:
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(converted), trust_remote_code=True, dtype=torch.float32)
    except Exception as exc:  # the model classes may not exist yet, or not support this layout
        return {"skipped": f"could not load the converted model: {type(exc).__name__}: {exc}"}
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.experts_format = "dense"
    reference = type(model)(config).to(torch.float32)
    state = _reference_state(src, provenance)
    missing, unexpected = reference.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("vision_tower.", "mm_projector."))]
    if missing:
        return {"skipped": None, "ok": False, "error": f"reference model lacks values for {missing[:5]}"}
    vocab = text.vocab_size
    input_ids = (torch.arange(num_tokens).unsqueeze(0) * 7919 + 11) % vocab
    model.eval()
    reference.eval()
    with torch.no_grad():
        got = model(input_ids=input_ids).logits.float()
        want = reference(input_ids=input_ids).logits.float()
    diff = float((got - want).abs().max())
    return {"skipped": None, "ok": diff == 0.0, "max_abs_diff": diff, "tokens": num_tokens,
            "ignored_keys": sorted(unexpected)[:5]}


def verify(src, converted, *, logits: str = "auto", max_logits_params: float = 2e8, tokens: int = 8,
           revision: str | None = None) -> dict:
    """Returns a report; `report["ok"]` is False on any mismatch. logits: "auto" | "always" | "never"."""
    converted = Path(converted)
    provenance_path = converted / PROVENANCE_NAME
    provenance = files.read_provenance(converted)
    with Checkpoint(converted) as conv, open_source(src, revision, 64 * 2**20) as source:
        if is_release_layout(conv):
            report = {"tensors": compare_release_layouts(source, conv),
                      "logits": {"skipped": "both folders are in the release layout (compared tensor by tensor)"}}
            report["ok"] = not report["tensors"]["mismatches"]
            return report
        layer_map = provenance.get("layer_map")
        if layer_map is None:
            layer_map, _ = make_layer_map(source.text_config, conv.text_config.num_hidden_layers)
        if len(layer_map) != conv.text_config.num_hidden_layers:
            raise ConversionError(f"{provenance_path}: layer_map has {len(layer_map)} layers, config.json "
                                  f"{conv.text_config.num_hidden_layers}")
        report = {"tensors": compare_tensors(source, conv, layer_map)}
        params = sum(conv.entry(n).nbytes for n in conv.weight_map) / 2
        if logits == "never" or (logits == "auto" and params > max_logits_params):
            report["logits"] = {"skipped": "disabled" if logits == "never" else f"model too large (~{params:.3g} "
                                "parameters); pass --logits always"}
        else:
            report["logits"] = compare_logits(source, converted, provenance, tokens)
    report["ok"] = not report["tensors"]["mismatches"] and report["logits"].get("ok", True) is not False
    return report
