"""`kimik3 verify A B`: any two folders of one model, in either order: the release (or an export, both in the
release layout) and ours (a conversion with dense or packed experts, a fine-tune, a `save_pretrained` of a loaded
model). Each folder's layout is detected from its names and config (`is_release_layout`).

1. Tensors. A release folder against one of ours: our folder is read back into the release's naming (the export
   direction of the name map, with experts split per expert), and every tensor is compared bit for bit with the
   release's value, following the layer / expert slicing of a `--num-layers` / `--num-experts` conversion (the
   layer map recorded in `kimik3_conversion.json`, identity when both have the same layers). Routed experts are
   compared as bytes where both sides keep them packed (MXFP4 codes and scales), else as exact dense values (the
   packed side dequantised). Different code paths do the two directions (fusing vs slicing), so a mistake in either
   shows up as a mismatch. The release folder is read with the `safetensors` library, not with our reader, so a
   header our parser misreads cannot make both sides agree.
   Two release-layout folders (a source and its export) are compared name by name, counting bytes-equal tensors
   apart from MXFP4 experts whose bytes differ but whose values are equal (a source that chose another valid E8M0
   scale than the OCP rule export uses). Two of our folders are compared name by name in our naming (a composite
   folder's `language_model.` prefix set aside when the other is text-only): packed against dense experts by exact
   value, tensors saved in another dtype by exact value, both counted apart from the bytes-equal ones.
   Everywhere `A_log` is compared after un-padding: the release stores it zero-padded to 128 (docs/design.md,
   "Parameter names"), ours at its live length; the padding must be +0.0.
2. Logits. Where one side is ours, it is loaded with `AutoModelForCausalLM.from_pretrained(...,
   trust_remote_code=True)` and compared with the same class built from the release's values in memory (dense
   experts), or with the other folder loaded the same way when both are ours, on a short fixed input. Skipped for
   models above `max_logits_params` parameters or when the model classes are not available.
"""

import copy
import re
from pathlib import Path

import torch
from kimik3.modeling.release_layout_kimi_k3 import RELEASE_MOE_BLOCK, RELEASE_TEXT_PREFIX
from kimik3.modeling.experts_format_kimi_k3 import DENSE, RELEASE
from kimik3.modeling.tokenization_kimi_k3 import NUM_RESERVED_SPECIAL

from kimik3 import name_map as nm

from . import files
from .checkpoint import Checkpoint
from .converter import open_source
from .errors import ConversionError, shard_error
from .files import PROVENANCE_NAME
from .mxfp4 import dequantize_mxfp4, quantize_rows
from .plan import ConvertOptions, RunContext, _fused_rows, build_convert_plan, build_export_plan, materialise
from .safetensors_io import E8M0
from .schedule import layer_map as make_layer_map

_LAYER_IN_NAME = re.compile(r"^(" + re.escape(RELEASE_TEXT_PREFIX) + r")?(model\.layers\.)(\d+)(\..*)$")
# The expert names of the release name map (name_map.py): a release part's suffixes, dense and packed, and the
# suffixes of our fused tensor kept packed.
(PLAIN,), (PACKED, SCALE) = nm.PLAIN_SUFFIXES, nm.PACKED_SUFFIXES
FUSED_PACKED, FUSED_SCALE = nm.FUSED_PACKED_SUFFIXES


class LibraryReader:
    """Tensors of a checkpoint read with the `safetensors` library (an independent parser), one shard open at a
    time (its memory map is released when the next shard is opened)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self._shard, self._handle = None, None

    def _read(self, name: str, get):
        """`get(handle)` on the safetensors library's handle of the shard holding `name` (kept open across reads of
        one shard); any failure names the file and the tensor."""
        from safetensors import safe_open

        shard = self.ckpt.shard_of(name)
        path = self.ckpt.shard_path(shard)
        try:
            if shard != self._shard:
                self._handle, self._shard = None, None
                self._handle, self._shard = safe_open(str(path), "pt"), shard
            return get(self._handle)
        except Exception as exc:  # SafetensorError, OSError, missing key: name the file, do not guess
            raise shard_error(path, f"the safetensors library cannot read it: {exc}", name) from None

    def read(self, name: str) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_tensor(name).clone())

    def read_index(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` alone (one expert of a fused [E, ...] tensor), without reading the rest."""
        return self._read(name, lambda handle: handle.get_slice(name)[index].clone())

    def read_shape(self, name: str) -> list[int]:
        return self._read(name, lambda handle: list(handle.get_slice(name).get_shape()))

    def close(self) -> None:
        self._handle, self._shard = None, None


def _source_value(src, lib: LibraryReader, release_name: str) -> torch.Tensor:
    name = release_name if src.composite else release_name.removeprefix(RELEASE_TEXT_PREFIX)
    if name in src.weight_map:
        return lib.read(name)
    base = name.removesuffix(f".{PLAIN}")
    if base != name and f"{base}.{PACKED}" in src.weight_map:
        return dequantize_mxfp4(lib.read(f"{base}.{PACKED}"), lib.read(f"{base}.{SCALE}"))
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


def _max_diff(a: torch.Tensor, b: torch.Tensor):
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _unpadded_a_log(value: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The live heads of an A_log stored at its length or zero-padded (+0.0 bit for bit); None if it is neither."""
    if value.dim() != 1 or value.shape[0] < heads:
        return None
    tail = value[heads:]
    if bool((tail != 0).any()) or bool(torch.signbit(tail).any()):
        return None
    return value[:heads]


def _compare_a_log(a: torch.Tensor, b: torch.Tensor, heads: int):
    """None when equal after un-padding, else what differs."""
    ua, ub = _unpadded_a_log(a, heads), _unpadded_a_log(b, heads)
    for value, side in ((ua, "first"), (ub, "second")):
        if value is None:
            return f"A_log {list((a if side == 'first' else b).shape)} in the {side} folder is not {heads} heads " \
                   "(optionally followed by +0.0 padding)"
    return None if _same_bits(ua, ub) else _max_diff(ua, ub)


def _is_a_log(name: str) -> bool:
    return name.endswith(".self_attn.A_log")


def _mxfp4_round_trip(dense: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """`dense` through the exporter's MXFP4 rule and back (groups of 32 along the last dim), and the error stats."""
    rows = dense.reshape(-1, dense.shape[-1])
    packed, scale, stats = quantize_rows(rows)
    return dequantize_mxfp4(packed, scale, dense.dtype).reshape(dense.shape), stats


def compare_tensors(src, conv, layer_map: list[int]) -> dict:
    """A release-layout folder `src` against one of ours `conv`, in the release's naming. Where `src` holds packed
    MXFP4 experts and `conv` dense ones (a fine-tune and its export, which re-quantised them), a routed expert whose
    dense values differ is compared again after the exporter's MXFP4 round trip of ours: equal there, it counts as
    re-quantised (with the measured error), not as a mismatch."""
    src_packed = any(n.endswith(f".{PACKED}") for n in src.weight_map)
    conv_packed = any(n.endswith(nm.FUSED_EXPERTS[0] + FUSED_PACKED) for n in conv.weight_map)
    both_packed = src_packed and conv_packed
    requantised = {"tensors": 0, "sum_sq_err": 0.0, "sum_sq_ref": 0.0, "max_abs_err": 0.0}
    plan = build_export_plan(conv, RunContext(), experts_format=(RELEASE if both_packed else DENSE).name)
    heads = nm.dims(conv.text_config)["H"]
    mismatches, compared = [], 0
    lib = LibraryReader(src)
    for tensor in plan.tensors:
        release_name = tensor.spec.name
        source_name = _to_source_name(release_name, layer_map)
        expected = _source_value(src, lib, source_name)
        relative = release_name.removeprefix(RELEASE_TEXT_PREFIX)
        scope = "vision" if relative.startswith(("vision_tower.", "mm_projector.")) else "text"
        match = nm.match_release(relative, conv.text_config, scope)
        if match is not None and getattr(match.rule, "transform", None) == "first_experts":
            expected = expected[: tensor.spec.shape[0]]
        actual = materialise(tensor)
        compared += 1
        if _is_a_log(release_name):
            diff = _compare_a_log(actual, expected, heads)
        else:
            diff = None if _same_bits(actual, expected) else _max_diff(actual, expected)
        if diff is not None and src_packed and not conv_packed and f"{RELEASE_MOE_BLOCK}.experts." in release_name \
                and actual.shape == expected.shape and actual.dim() == 2:
            round_trip, stats = _mxfp4_round_trip(actual)
            if _same_bits(round_trip, expected.to(round_trip.dtype)):
                diff = None
                requantised["tensors"] += 1
                for key in ("sum_sq_err", "sum_sq_ref"):
                    requantised[key] += stats[key]
                requantised["max_abs_err"] = max(requantised["max_abs_err"], stats["max_abs_err"])
        if diff is not None:
            mismatches.append({"tensor": release_name, "source": source_name, "max_abs_diff": diff})
    lib.close()
    report = {"compared": compared, "mismatches": mismatches,
              "experts": "bytes (both packed)" if both_packed else "dense values"}
    if requantised["tensors"]:
        report["requantised"] = {
            "tensors": requantised["tensors"], "max_abs_err": requantised["max_abs_err"],
            "relative_rms": (requantised["sum_sq_err"] / requantised["sum_sq_ref"]) ** 0.5
            if requantised["sum_sq_ref"] else 0.0}
    return report


def is_release_layout(ckpt) -> bool:
    text = ckpt.config_dict.get("text_config")
    return (isinstance(text, dict) and "quantization_config" in text) or any(
        f".{RELEASE_MOE_BLOCK}." in name for name in ckpt.weight_map)


def _tensor_group(name: str) -> tuple[str, ...]:
    """An MXFP4 expert is compared as its (packed, scale) pair: equal values can come from different bytes."""
    for suffix in (PACKED, SCALE):
        if name.endswith(f".{suffix}"):
            base = name[: -len(suffix)]
            return (base + PACKED, base + SCALE)
    return (name,)


def compare_release_layouts(src, other) -> dict:
    """Two release-layout folders (a source and its export), name by name: bytes-equal tensors, MXFP4 pairs whose
    bytes differ but whose dequantised values are equal, and mismatches (missing names included)."""
    lib = LibraryReader(src)
    heads = nm.dims(src.text_config)["H"]
    mismatches, bytes_equal, values_equal, done = [], 0, 0, set()
    for name in sorted(set(src.weight_map) | set(other.weight_map)):
        if name in done:
            continue
        group = _tensor_group(name)
        done.update(group)
        absent = [n for n in group if n not in src.weight_map or n not in other.weight_map]
        if absent:
            side = "first folder" if absent[0] not in src.weight_map else "second folder"
            mismatches.append({"tensor": absent[0], "source": absent[0], "max_abs_diff": f"missing in the {side}"})
            continue
        want = [lib.read(n) for n in group]
        got = [other.reader(n).read(n, E8M0 if n.endswith(FUSED_SCALE) else None) for n in group]
        if all(_same_bits(a, b) for a, b in zip(got, want)):
            bytes_equal += len(group)
        elif _is_a_log(name) and _compare_a_log(got[0], want[0], heads) is None:
            values_equal += 1  # the same heads, padded to another length
        elif len(group) == 2 and all(a.shape == b.shape for a, b in zip(got, want)) and torch.equal(
                dequantize_mxfp4(*got, torch.float32), dequantize_mxfp4(*want, torch.float32)):
            values_equal += len(group)
        else:
            diff = _compare_a_log(got[0], want[0], heads) if _is_a_log(name) else _max_diff(got[0], want[0])
            mismatches.append({"tensor": name, "source": name, "max_abs_diff": diff})
    lib.close()
    return {"compared": len(done), "bytes_equal": bytes_equal, "values_equal_bytes_differ": values_equal,
            "mismatches": mismatches}


def _our_groups(ckpt, strip_prefix: bool) -> dict:
    """Our folder's tensors by the name they are compared under: a fused expert tensor's packed pair under the dense
    name (`...experts.gate_up_proj`), the composite prefix removed when the other folder is text-only."""
    groups: dict = {}
    for name in ckpt.weight_map:
        key = name.removeprefix(RELEASE_TEXT_PREFIX) if strip_prefix else name
        base = key
        for suffix in nm.FUSED_PACKED_SUFFIXES:
            if key.endswith(tuple(fused + suffix for fused in nm.FUSED_EXPERTS)):
                base = key[: -len(suffix)]
        groups.setdefault(base, []).append(name)
    return groups


def _forms(names: list[str]) -> list[str]:
    """How a compared tensor is stored: [""] dense, ["_packed", "_scale"] packed."""
    return [next((s for s in nm.FUSED_PACKED_SUFFIXES if n.endswith(s)), "") for n in names]


def _dense_of(names: list[str], raw: list[torch.Tensor]) -> torch.Tensor:
    """One compared tensor of our layout: dense as stored, or the packed pair dequantised (exact in f32)."""
    if _forms(names) == [""]:
        return raw[0]
    parts = dict(zip(_forms(names), raw))
    return dequantize_mxfp4(parts[FUSED_PACKED], parts[FUSED_SCALE], torch.float32)


def _compare_values(key: str, names_a, raw_a, names_b, raw_b, heads: int):
    """"bytes" (the same bytes, packed experts: codes and scales), "values" (equal values, other bytes) or what
    differs."""
    if _forms(names_a) == _forms(names_b) and all(_same_bits(a, b) for a, b in zip(raw_a, raw_b)):
        return "bytes"
    a, b = _dense_of(names_a, raw_a), _dense_of(names_b, raw_b)
    if _is_a_log(key):
        diff = _compare_a_log(a.float(), b.float(), heads)
    elif not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        diff = f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    else:
        # exact in float64 for every floating dtype a checkpoint holds (bf16, f16, f32)
        diff = None if a.shape == b.shape and torch.equal(a.double(), b.double()) else _max_diff(a, b)
    return "values" if diff is None else diff


def _is_fused_experts(key: str) -> bool:
    return key.endswith(nm.FUSED_EXPERTS)


def compare_our_layouts(first, second) -> dict:
    """Two of our folders (a conversion and a fine-tune or save_pretrained of it, dense and packed experts), name by
    name: bytes-equal tensors (packed experts: codes and scales), and tensors equal in value with other bytes
    (packed vs dense experts, another dtype, A_log padded to another length). Fused experts are read an expert at a
    time (a whole K3 layer's would be tens of GB in f32)."""
    lib = LibraryReader(first)
    strip = first.composite != second.composite
    groups_a, groups_b = _our_groups(first, strip and first.composite), _our_groups(second, strip and second.composite)
    heads = nm.dims(first.text_config)["H"]

    def read_b(name, expert=None):
        if expert is None:
            return second.reader(name).read(name, E8M0 if name.endswith(FUSED_SCALE) else None)
        return _fused_rows(second, name, expert, (0, second.entry(name).shape[1]))

    mismatches, bytes_equal, values_equal = [], 0, 0
    for key in sorted(set(groups_a) | set(groups_b)):
        names_a, names_b = sorted(groups_a.get(key, [])), sorted(groups_b.get(key, []))
        if not names_a or not names_b:
            side = "first folder" if not names_a else "second folder"
            shown = (names_b or names_a)[0]
            mismatches.append({"tensor": shown, "source": shown, "max_abs_diff": f"missing in the {side}"})
            continue
        experts = [lib.read_shape(names_a[0])[0], second.entry(names_b[0]).shape[0]] if _is_fused_experts(key) \
            else None
        if experts is None:
            outcome = _compare_values(key, names_a, [lib.read(n) for n in names_a], names_b,
                                      [read_b(n) for n in names_b], heads)
        elif experts[0] != experts[1]:
            outcome = f"{experts[0]} vs {experts[1]} experts"
        else:
            outcomes = [_compare_values(key, names_a, [lib.read_index(n, e) for n in names_a], names_b,
                                        [read_b(n, e) for n in names_b], heads) for e in range(experts[0])]
            differ = [o for o in outcomes if o not in ("bytes", "values")]
            outcome = differ[0] if differ else "values" if "values" in outcomes else "bytes"
            if differ and all(isinstance(o, float) for o in differ):
                outcome = max(differ)
        if outcome == "bytes":
            bytes_equal += 1
        elif outcome == "values":
            values_equal += 1
        else:
            mismatches.append({"tensor": names_b[0], "source": names_a[0], "max_abs_diff": outcome})
    lib.close()
    return {"compared": len(set(groups_a) | set(groups_b)), "bytes_equal": bytes_equal,
            "values_equal_bytes_differ": values_equal, "mismatches": mismatches,
            "values_equal_why": "packed vs dense experts, another dtype, or A_log padded to another length"}


def _slicing(release, ours, provenance: dict) -> ConvertOptions:
    """The conversion options that make `release` into `ours` (layers, experts, text only), read from the two
    configs: the same for a conversion of the release and for a release exported from ours."""
    r_text, o_text = release.text_config, ours.text_config
    return ConvertOptions(
        text_only=not ours.composite,
        experts_format=DENSE.name,
        num_layers=o_text.num_hidden_layers if o_text.num_hidden_layers != r_text.num_hidden_layers else None,
        num_experts=o_text.num_experts if o_text.num_experts != r_text.num_experts else None,
        allow_unknown=provenance.get("options", {}).get("allow_unknown", False),
    )


def _layer_map(release, ours, provenance: dict, provenance_path: Path) -> list[int]:
    count = ours.text_config.num_hidden_layers
    if count == release.text_config.num_hidden_layers:
        return list(range(count))
    layer_map = provenance.get("layer_map")
    if layer_map is None:
        layer_map, _ = make_layer_map(release.text_config, count)
    if len(layer_map) != count:
        raise ConversionError(f"{provenance_path}: layer_map has {len(layer_map)} layers, config.json {count}")
    return layer_map


def _load_ours(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32).eval()
    # Tensors stored in f32 are loaded as views of the mmap-ed shard, at the file's offsets (4-byte aligned), while
    # converted (bf16) or in-memory ones get fresh 64-byte-aligned memory. CPU BLAS (MKL) sums a one- to three-row
    # product in an order that depends on its operands' alignment, so equal values placed differently gave logits
    # apart by ~1e-6. Every tensor in fresh memory: the logits compared are a function of the values alone.
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = tensor.data.clone()
    return model


def _fixed_input(vocab: int, num_tokens: int) -> torch.Tensor:
    """Ids spread over the ordinary tokens only: the reserved specials at the vocabulary's end include
    `<|media_pad|>`, which a model with a vision tower refuses without an image."""
    ordinary = vocab - NUM_RESERVED_SPECIAL if vocab > NUM_RESERVED_SPECIAL else vocab
    return (torch.arange(num_tokens).unsqueeze(0) * 7919 + 11) % ordinary


def compare_logits(src, converted: Path, options: ConvertOptions, num_tokens: int,
                   requantised: bool = False) -> dict:
    """Our folder's logits against a model of the release folder's values. `requantised`: the release folder's
    experts are ours re-quantised to MXFP4 (an export), so ours go through the same round trip first."""
    try:
        model = _load_ours(converted)
    except Exception as exc:  # the model classes may not exist yet, or not support this layout
        return {"skipped": f"could not load the converted model: {type(exc).__name__}: {exc}"}
    if requantised:
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if name.endswith(tuple(nm.FUSED_EXPERTS)):
                    tensor.copy_(_mxfp4_round_trip(tensor.detach())[0])
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.experts_format = DENSE.name
    reference = type(model)(config).to(torch.float32)
    state = {t.spec.name: materialise(t) for t in build_convert_plan(src, options).tensors}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("vision_tower.", "mm_projector."))]
    if missing:
        return {"skipped": None, "ok": False, "error": f"reference model lacks values for {missing[:5]}"}
    input_ids = _fixed_input(text.vocab_size, num_tokens)
    reference.eval()
    with torch.no_grad():
        got = model(input_ids=input_ids).logits.float()
        want = reference(input_ids=input_ids).logits.float()
    diff = float((got - want).abs().max())
    return {"skipped": None, "ok": diff == 0.0, "max_abs_diff": diff, "tokens": num_tokens,
            "ignored_keys": sorted(unexpected)[:5]}


def compare_our_logits(first: Path, second: Path, num_tokens: int) -> dict:
    try:
        models = [_load_ours(first), _load_ours(second)]
    except Exception as exc:
        return {"skipped": f"could not load both models: {type(exc).__name__}: {exc}"}
    input_ids = _fixed_input(models[0].config.get_text_config().vocab_size, num_tokens)
    with torch.no_grad():
        got, want = (m(input_ids=input_ids).logits.float() for m in models)
    diff = float((got - want).abs().max()) if got.shape == want.shape else f"shape {list(got.shape)} vs " \
                                                                             f"{list(want.shape)}"
    return {"skipped": None, "ok": diff == 0.0, "max_abs_diff": diff, "tokens": num_tokens}


def _logits_too_large(ours, logits: str, max_logits_params: float) -> str | None:
    params = sum(ours.entry(n).nbytes for n in ours.weight_map) / 2
    if logits == "never":
        return "disabled"
    if logits == "auto" and params > max_logits_params:
        return f"model too large (~{params:.3g} parameters); pass --logits always"
    return None


def verify(src, converted, *, logits: str = "auto", max_logits_params: float = 2e8, tokens: int = 8,
           revision: str | None = None) -> dict:
    """Compares two folders of one model, each in either layout (`src` may be a Hub repo id). Returns a report;
    `report["ok"]` is False on any mismatch. logits: "auto" | "always" | "never"."""
    converted = Path(converted)
    with Checkpoint(converted) as second, open_source(src, revision, 64 * 2**20) as first:
        release = [is_release_layout(first), is_release_layout(second)]
        report = {"layouts": ["release" if r else "ours" for r in release]}
        layers = [c.text_config.num_hidden_layers for c in (first, second)]
        if release[0] == release[1] and layers[0] != layers[1]:
            # a sliced conversion is compared with its release source, which the layer map of its record relates
            raise ConversionError(f"{converted}: {layers[1]} layers, {src}: {layers[0]}; two folders of one layout are "
                                  "compared layer by layer, so they must have the same layers (compare a "
                                  "`--num-layers` conversion with the release it was converted from)")
        if all(release):
            report["tensors"] = compare_release_layouts(first, second)
            report["logits"] = {"skipped": "both folders are in the release layout (compared tensor by tensor)"}
        elif not any(release):
            report["tensors"] = compare_our_layouts(first, second)
            skipped = _logits_too_large(second, logits, max_logits_params)
            report["logits"] = {"skipped": skipped} if skipped else compare_our_logits(first.root, converted, tokens)
        else:
            rel, ours = (first, second) if release[0] else (second, first)
            provenance = files.read_provenance(ours.root)
            layer_map = _layer_map(rel, ours, provenance, ours.root / PROVENANCE_NAME)
            report["tensors"] = compare_tensors(rel, ours, layer_map)
            requantised = "requantised" in report["tensors"]
            skipped = _logits_too_large(ours, logits, max_logits_params)
            report["logits"] = {"skipped": skipped} if skipped else compare_logits(
                rel, ours.root, _slicing(rel, ours, provenance), tokens, requantised=requantised)
            if requantised:
                report["logits"]["experts_requantised"] = True
    report["ok"] = not report["tensors"]["mismatches"] and report["logits"].get("ok", True) is not False
    return report
