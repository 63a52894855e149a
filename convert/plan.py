"""Plans: the list of output tensors, each with its layout (name, dtype, shape) and a producer that streams its bytes.

Both directions evaluate the rule tables of `name_map.py` through its one walk (`name_map.walk`): convert reads
the release side of each site and writes ours, export the other way round. A producer yields the tensor's bytes in
order as a sequence of chunks; the writer keeps one chunk in flight while the next is produced, so peak memory is
about two chunks, whatever the model or tensor size:
  * plain tensors (all non-expert tensors) are copied as byte ranges of at most `chunk_bytes` (64 MiB by default);
  * fused experts are produced a few experts at a time (as many as fit in `chunk_bytes` of output, at least one)
    into one preallocated batch buffer, dequantised in row blocks of 1M weights, and go straight into the output
    file: the fused [E, 2I, Dl] tensor itself (39.5 GB per K3 layer in bf16) is never materialised.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from kimik3.modeling.configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT, RELEASE_EXPERTS_FORMAT
from kimik3.modeling.release_layout_kimi_k3 import RELEASE_MOE_BLOCK, RELEASE_TEXT_PREFIX
from kimik3.modeling.experts_format_kimi_k3 import DENSE, RELEASE, ExpertsFormat

from . import files
from kimik3 import name_map as nm
from .errors import ConversionError, shard_error
from .mxfp4 import MXFP4_GROUP_SIZE, check_finite_decode, dequantize_into, packed_shapes, quantize_rows
from .safetensors_io import DEFAULT_CHUNK_BYTES, DTYPES, E8M0, OutSpec, itemsize

# The expert names of the release name map (name_map.py): a release part's suffixes, dense and packed, and the
# suffixes of our fused tensor kept packed.
(PLAIN,), (PACKED, SCALE) = nm.PLAIN_SUFFIXES, nm.PACKED_SUFFIXES
FUSED_PACKED, FUSED_SCALE = nm.FUSED_PACKED_SUFFIXES

# The expert storages the offline converter streams: the release's own two (its coded format and plain bf16 parts),
# each read and written in row blocks (here). Another registered format (experts_format_kimi_k3.py) is a load
# option of `from_pretrained`, which converts at load time through the format object.
STREAMED_FORMATS: dict[str, ExpertsFormat] = {DENSE.name: DENSE, RELEASE.name: RELEASE}


def streamed_format(name: str) -> ExpertsFormat:
    if name not in STREAMED_FORMATS:
        raise ConversionError(
            f"--experts-format {name!r}: the converter writes {' or '.join(STREAMED_FORMATS)} (the release's expert "
            "storages); load another registered format with from_pretrained(..., experts_format=...)"
        )
    return STREAMED_FORMATS[name]


TEXT_PREFIX = RELEASE_TEXT_PREFIX  # the release name map's (our composite model nests its text model alike)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


@dataclass
class OutTensor:
    spec: OutSpec
    produce: Callable[[], Iterator[torch.Tensor]]
    origin: str  # where the bytes come from; part of the resume fingerprint
    group: str = "model"  # export: which release shard it belongs to ("layer:<L>", "model", "projector", "vision")


@dataclass
class RunContext:
    """Shared by the producers of one run: the shard being written and per-shard statistics (export errors)."""

    shard: str | None = None
    stats: dict = field(default_factory=dict)

    def add(self, **values) -> None:
        bucket = self.stats.setdefault(self.shard or "", {})
        for key, value in values.items():
            if key.startswith("max_"):
                bucket[key] = max(bucket.get(key, 0.0), value)
            else:
                bucket[key] = bucket.get(key, 0) + value


# ------------------------------------------------------------------------------------------------------------------
# Producers (the named transforms of the table)


def copy_bytes(ckpt, name: str, nbytes: int | None = None):
    """`copy` and `first_experts`: a prefix of the source bytes (rows are contiguous, so the first E rows are a byte
    prefix), streamed in chunks."""

    def produce():
        yield from ckpt.reader(name).iter_byte_chunks(name, nbytes)

    return produce


def cast_tensor(ckpt, name: str, dtype: torch.dtype):
    def produce():
        yield ckpt.reader(name).read(name).to(dtype)

    return produce


def unpad_heads(ckpt, name: str, heads: int):
    """Release A_log [A] (any A >= H) -> ours [H]; the padding must be exactly +0.0 (bit for bit, so that export can
    restore it), or the file is not what we think it is."""

    def produce():
        full = ckpt.reader(name).read(name)
        tail = full[heads:]
        nonzero = torch.nonzero(tail.view(torch.int32) != 0)
        if nonzero.numel():
            first = heads + int(nonzero[0, 0])
            raise shard_error(
                ckpt.reader(name).path,
                f"A_log has {full.numel()} entries of which {heads} are heads; the padding must be zero but entry "
                f"{first} is {float(full[first])!r}",
                name,
            )
        yield full[:heads].clone()

    return produce


def pad_heads(ckpt, name: str, length: int, dtype: torch.dtype):
    """Ours [H] -> release [length], zero padded (export; the length the source had, see `release_a_log_length`)."""

    def produce():
        values = ckpt.reader(name).read(name).to(dtype)
        padded = torch.zeros(length, dtype=dtype)
        padded[: values.numel()] = values
        yield padded

    return produce


def _batches(count: int, per_item_bytes: int, chunk_bytes: int):
    step = max(1, chunk_bytes // max(1, per_item_bytes))
    for start in range(0, count, step):
        yield range(start, min(count, start + step))


def fused_experts(ckpt, part_names, tensor: str, per_expert_out_bytes: int, chunk_bytes: int):
    """Our fused expert tensor from per-expert release tensors, a batch of experts at a time, each written into its
    place in one preallocated batch buffer (no stack / cat copies).

    part_names[e] lists, per part (w1, w3 | w2), the release names: (packed, scale) or (weight,).
    tensor: which of our tensors: "dense" (bf16; dequantised when the source is MXFP4), or the "packed" / "scale"
    half of kept MXFP4 experts (bytes copied).
    Memory: one batch buffer (<= max(chunk_bytes, one expert's output)) + one source part + the dequant block.
    """

    def read(name, encoding=None):
        return ckpt.reader(name).read(name, encoding)

    def fill(out, names):
        if tensor == "scale":
            out.copy_(read(names[1], E8M0))
        elif tensor == "dense" and len(names) == 2:
            dequantize_into(out, read(names[0]), read(names[1], E8M0),
                            f"{ckpt.reader(names[1]).path}, tensor `{names[1]}`")
        else:
            out.copy_(read(names[0]))

    def produce():
        first = part_names[0]
        shapes = [ckpt.entry(names[0 if tensor != "scale" else 1]).shape for names in first]
        rows = sum(shape[0] for shape in shapes)
        width = shapes[0][1] * (2 if tensor == "dense" and len(first[0]) == 2 else 1)
        dtype = torch.bfloat16 if tensor == "dense" else torch.uint8
        for experts in _batches(len(part_names), per_expert_out_bytes, chunk_bytes):
            out = torch.empty(len(experts), rows, width, dtype=dtype)
            for slot, expert in enumerate(experts):
                row = 0
                for names, shape in zip(part_names[expert], shapes):
                    fill(out[slot, row:row + shape[0]], names)
                    row += shape[0]
            yield out
            del out

    return produce


class _ExpertCache:
    """Export reads each expert's slice of a fused tensor once and serves its packed and scale outputs from it."""

    def __init__(self, size: int = 4):
        self.size = size
        self.items: OrderedDict = OrderedDict()

    def get(self, key, compute):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = compute()
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


def _fused_rows(ckpt, name: str, expert: int, rows: tuple[int, int]) -> torch.Tensor:
    """Rows [r0, r1) of expert `expert` of our fused [E, R, C] tensor, read as one contiguous byte range."""
    entry = ckpt.entry(name)
    _, total_rows, cols = entry.shape
    row_bytes = cols * itemsize(entry.dtype)
    start = (expert * total_rows + rows[0]) * row_bytes
    encoding = E8M0 if name.endswith(FUSED_SCALE) else None
    data = ckpt.reader(name).read_bytes(name, start, start + (rows[1] - rows[0]) * row_bytes, encoding)
    return data.view(entry.torch_dtype).reshape(rows[1] - rows[0], cols)


def export_expert_part(ckpt, ours: str, stored: ExpertsFormat, expert: int, rows, suffix: str, cache, context):
    """One release expert tensor (`weight_packed` / `weight_scale` / dense `weight`) from our fused tensors, which
    are stored in `stored` (one of name_map.STREAMED_FORMATS)."""

    def where():
        return f"{ckpt.reader(ours + FUSED_SCALE).path}, tensor `{ours}{FUSED_SCALE}`"

    def quantized():
        if stored is RELEASE:
            packed = _fused_rows(ckpt, ours + FUSED_PACKED, expert, rows)
            scale = _fused_rows(ckpt, ours + FUSED_SCALE, expert, rows)
            # the copied bytes are what the release's code decodes to bf16
            check_finite_decode(packed, scale, torch.bfloat16, where(), (expert,), rows[0])
            return packed, scale
        # the round-trip error of re-quantisation, measured on every expert
        q_packed, q_scale, stats = quantize_rows(_fused_rows(ckpt, ours, expert, rows))
        context.add(experts=1, **stats)
        return q_packed, q_scale

    def dense_values():
        if stored is RELEASE:
            values = torch.empty(rows[1] - rows[0], ckpt.entry(ours + FUSED_PACKED).shape[-1] * 2,
                                 dtype=torch.bfloat16)
            dequantize_into(values, _fused_rows(ckpt, ours + FUSED_PACKED, expert, rows),
                             _fused_rows(ckpt, ours + FUSED_SCALE, expert, rows), where(), (expert,), rows[0])
            return values
        return _fused_rows(ckpt, ours, expert, rows).to(torch.bfloat16)

    def produce():
        if suffix == PLAIN:
            yield cache.get((ours, expert, rows, "dense"), dense_values)
        else:
            q_packed, q_scale = cache.get((ours, expert, rows, "q"), quantized)
            yield q_packed if suffix == PACKED else q_scale

    return produce


# ------------------------------------------------------------------------------------------------------------------
# Convert: release -> ours


@dataclass
class ConvertOptions:
    text_only: bool = False
    experts_format: str = DEFAULT_EXPERTS_FORMAT  # one of configuration_kimi_k3.EXPERTS_FORMATS
    num_layers: int | None = None
    num_experts: int | None = None
    allow_unknown: bool = False
    max_shard_bytes: int = 5 * 10**9
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


@dataclass
class Classified:
    matches: dict  # release name -> Match
    unknown: list
    expert_suffixes: dict  # layer -> set of release storage suffixes present


def _split_scope(name: str, composite: bool):
    if name.startswith(VISION_PREFIXES):
        return name, "vision"
    if composite:
        return (name[len(TEXT_PREFIX):], "text") if name.startswith(TEXT_PREFIX) else (None, None)
    return name, "text"


def _scoped_name(ckpt, name: str):
    """(name relative to its model, "text" | "vision"), or (None, None) outside both; a text layer the config does
    not have is an error naming the index, tensor and shard."""
    relative, scope = _split_scope(name, ckpt.composite)
    if scope == "text":
        layer = nm.layer_of(relative)
        layers = ckpt.text_config.num_hidden_layers
        if layer is not None and layer >= layers:
            raise ConversionError(
                f"{ckpt.index_path}: tensor `{name}` (shard {ckpt.weight_map[name]}) is in layer {layer}, but "
                f"config.json has num_hidden_layers={layers} (layers 0..{layers - 1})"
            )
    return relative, scope


def classify_release(src) -> Classified:
    text = src.text_config
    symbols = nm.dims(text, src.vision_config)
    matches, unknown, suffixes = {}, [], {}
    for name in sorted(src.weight_map):
        relative, scope = _scoped_name(src, name)
        if relative is None:
            unknown.append(name)
            continue
        match = nm.match_release(relative, text, scope)
        if match is None:
            unknown.append(name)
            continue
        if match.expert is not None:
            if match.expert >= symbols["E"]:
                raise ConversionError(
                    f"{src.index_path}: tensor `{name}` is expert {match.expert}, but config.json has "
                    f"num_experts={symbols['E']}"
                )
            suffixes.setdefault(match.layer, set()).add(match.suffix)
        if match.block is not None and match.block >= symbols.get("VB", 0):
            raise ConversionError(
                f"{src.index_path}: tensor `{name}` is vision block {match.block}, but the vision config has "
                f"{symbols.get('VB', 0)} blocks"
            )
        matches[name] = match
    return Classified(matches, unknown, suffixes)


def _check_entry(src, name: str, dtype: str, shape: tuple[int, ...], why: str):
    if name not in src.weight_map:
        raise ConversionError(f"{src.index_path}: tensor `{name}` is missing from the index ({why})")
    entry = src.entry(name)
    if entry.dtype != dtype or tuple(entry.shape) != tuple(shape):
        raise shard_error(
            src.shard_path(src.weight_map[name]),
            f"expected {dtype} {list(shape)} ({why}), found {entry.dtype} {list(entry.shape)}",
            name,
        )
    return entry


def _check_padded_heads(src, name: str, dtype: str, heads: int, usual: tuple[int, ...], why: str):
    """A_log: the official code declares [H], the release stores [128] (96 heads + zeros), other checkpoints pad
    differently; any 1-D length >= H is accepted (its tail is checked when read)."""
    if name not in src.weight_map:
        raise ConversionError(f"{src.index_path}: tensor `{name}` is missing from the index ({why})")
    entry = src.entry(name)
    if entry.dtype != dtype or len(entry.shape) != 1 or entry.shape[0] < heads:
        raise shard_error(
            src.shard_path(src.weight_map[name]),
            f"expected {dtype} {list(usual)} ({why}; any length >= {heads} heads with a zero tail is accepted), "
            f"found {entry.dtype} {list(entry.shape)}",
            name,
        )
    return entry


def _source_experts_format(src, classified: Classified, layer: int, prefix: str) -> ExpertsFormat:
    """How the source stores a layer's experts: coded as the release (`weight_packed` + `weight_scale`) or dense
    (`weight`)."""
    present = classified.expert_suffixes.get(layer, set())
    packed = bool(present & {PACKED, SCALE})
    if packed and PLAIN in present:
        raise ConversionError(
            f"{src.index_path}: layer {layer} mixes packed ({PACKED}/{SCALE}) and plain ({PLAIN}) experts "
            f"under `{prefix}model.layers.{layer}.{RELEASE_MOE_BLOCK}.experts`"
        )
    return DENSE if present == {PLAIN} else RELEASE


def _expert_part_sources(src, site: nm.Site, source_format: ExpertsFormat, keep: int, symbols):
    """Validated release names of every kept expert's parts: [[(names of part 0), (names of part 1)], ...]."""
    logical = nm.shape_of(site.rule.part_shape, symbols)
    packed_shape, scale_shape = packed_shapes(logical)
    out = []
    for expert in range(keep):
        per_part = []
        for part in site.rule.parts:
            base = site.release_expert(expert, part)
            why = f"expert {expert} `{part}` of MoE layer {site.release_layer}"
            if source_format is DENSE:
                _check_entry(src, f"{base}.{PLAIN}", "BF16", logical, why)
                per_part.append((f"{base}.{PLAIN}",))
                continue
            packed_name, scale_name = f"{base}.{PACKED}", f"{base}.{SCALE}"
            for name in (packed_name, scale_name):
                if name not in src.weight_map:
                    raise ConversionError(f"{src.index_path}: tensor `{name}` is missing from the index ({why})")
            p, s = src.entry(packed_name), src.entry(scale_name)
            if (p.dtype, tuple(p.shape), s.dtype, tuple(s.shape)) != ("U8", packed_shape, "U8", scale_shape):
                raise shard_error(
                    src.shard_path(src.weight_map[packed_name]),
                    f"MXFP4 packed/scale shapes do not match: logical {list(logical)} (group {MXFP4_GROUP_SIZE}) "
                    f"needs U8 packed {list(packed_shape)} and U8 scale {list(scale_shape)}, found {p.dtype} "
                    f"{list(p.shape)} and {s.dtype} {list(s.shape)} (`{scale_name}`)",
                    packed_name,
                )
            per_part.append((packed_name, scale_name))
        out.append(per_part)
    return out


@dataclass
class ConvertPlan:
    tensors: list[OutTensor]
    text_config: object
    layer_map: list[int]
    num_experts: int | None
    notes: list[str]
    skipped_unknown: list[str]
    source_names: set
    a_log_lengths: dict = field(default_factory=dict)  # output layer -> length of the source's padded A_log

    def release_a_log_length(self):
        """What the provenance records for export: one length when all layers agree (the usual case), else
        {output layer: length}; None without KDA layers."""
        lengths = set(self.a_log_lengths.values())
        if len(lengths) <= 1:
            return lengths.pop() if lengths else None
        return {str(layer): length for layer, length in sorted(self.a_log_lengths.items())}


def build_convert_plan(src, options: ConvertOptions) -> ConvertPlan:
    from .schedule import layer_map as make_layer_map, output_text_config

    text = src.text_config
    symbols = nm.dims(text, src.vision_config)
    classified = classify_release(src)
    notes = []
    if classified.unknown:
        shown = ", ".join(f"`{n}` ({src.weight_map[n]})" for n in classified.unknown[:5])
        if not options.allow_unknown:
            raise ConversionError(
                f"{src.index_path}: {len(classified.unknown)} tensor name(s) have no rule in the name map: {shown}"
                f"{' ...' if len(classified.unknown) > 5 else ''}; pass --allow-unknown to skip them"
            )
        notes.append(f"skipped {len(classified.unknown)} unknown tensor(s), e.g. {shown}")

    mapping, note = make_layer_map(text, options.num_layers)
    if note:
        notes.append(note)
    total_experts = symbols["E"]
    keep = total_experts
    if options.num_experts is not None and total_experts:
        if not 1 <= options.num_experts <= total_experts:
            raise ConversionError(f"--num-experts {options.num_experts}: the source has {total_experts} experts")
        keep = options.num_experts
    experts_format = streamed_format(options.experts_format)
    out_text = output_text_config(text, mapping, keep if total_experts else None, experts_format.name)
    if out_text.num_experts and out_text.num_experts_per_token != text.num_experts_per_token:
        notes.append(f"num_experts_per_token lowered to {out_text.num_experts_per_token} (only {keep} experts kept)")

    text_out_prefix = "" if options.text_only or not src.composite else TEXT_PREFIX
    src_prefix = TEXT_PREFIX if src.composite else ""
    tensors: list[OutTensor] = []
    used: set = set()
    a_log_lengths: dict = {}

    def add_tensor(site: nm.Site):
        rule, src_name, out_name = site.rule, site.release, site.ours
        shape = nm.shape_of(rule.shape, symbols)
        if rule.transform == "unpad_heads":
            heads = symbols["H"]
            entry = _check_padded_heads(src, src_name, rule.dtype, heads, shape, site.why)
            a_log_lengths[site.layer] = entry.shape[0]
        else:
            entry = _check_entry(src, src_name, rule.dtype, shape, site.why)
        used.add(src_name)
        if rule.transform == "unpad_heads":
            spec = OutSpec(out_name, rule.dtype, (heads,))
            produce = unpad_heads(src, src_name, heads)
        elif rule.transform == "first_experts" and keep != total_experts:
            spec = OutSpec(out_name, rule.dtype, (keep,) + shape[1:])
            produce = copy_bytes(src, src_name, spec.nbytes)
        else:
            spec = OutSpec(out_name, rule.dtype, shape)
            produce = copy_bytes(src, src_name, entry.nbytes)
        tensors.append(OutTensor(spec, produce, f"{rule.transform}:{src_name}", site.group))

    def add_experts(site: nm.Site):
        rule, src_layer = site.rule, site.release_layer
        source_format = _source_experts_format(src, classified, src_layer, src_prefix)
        if experts_format is RELEASE and source_format is DENSE:
            raise ConversionError(
                f"{src.index_path}: --experts-format {RELEASE.name} keeps packed experts, but layer {src_layer}'s "
                f"experts are plain bf16 (`.weight`); convert with --experts-format {DENSE.name}"
            )
        parts = _expert_part_sources(src, site, source_format, keep, symbols)
        used.update(n for per_part in parts for names in per_part for n in names)
        logical = [nm.shape_of(rule.part_shape, symbols) for _ in rule.parts]
        rows = sum(shape[0] for shape in logical)
        cols = logical[0][1]
        origin = f"experts:{site.release_expert('*', '|'.join(rule.parts))}"
        if experts_format is DENSE:
            spec = OutSpec(site.ours, "BF16", (keep, rows, cols))
            produce = fused_experts(src, parts, "dense", rows * cols * 2, options.chunk_bytes)
            tensors.append(OutTensor(spec, produce, origin + ":dense", site.group))
            return
        for half, width in (("packed", cols // 2), ("scale", cols // MXFP4_GROUP_SIZE)):
            spec = OutSpec(f"{site.ours}_{half}", "U8", (keep, rows, width))
            produce = fused_experts(src, parts, half, rows * width, options.chunk_bytes)
            tensors.append(OutTensor(spec, produce, f"{origin}:{half}", site.group))

    has_vision = any(getattr(m.rule, "scope", "text") == "vision" for m in classified.matches.values())
    with_vision = src.composite and not options.text_only and has_vision
    if with_vision and "VH" not in symbols:
        raise ConversionError(f"{src.root / 'config.json'}: the index has vision tensors but vision_config "
                              "lacks the MoonViT sizes")
    for site in nm.walk(text, symbols, mapping, src_prefix, text_out_prefix, with_vision):
        (add_experts if isinstance(site.rule, nm.ExpertRule) else add_tensor)(site)
    if src.composite and not options.text_only and not has_vision:
        notes.append("the source has no vision tensors; none are written")
    return ConvertPlan(tensors, out_text, mapping, keep if total_experts else None, notes, classified.unknown, used,
                       a_log_lengths)


# ------------------------------------------------------------------------------------------------------------------
# Export: ours -> release


@dataclass
class ExportPlan:
    tensors: list[OutTensor]
    notes: list[str]
    requantised: bool = False  # some dense experts were quantised to MXFP4 (their bytes are not the source's)


def _classify_ours(ckpt):
    text = ckpt.text_config
    matches, unknown = {}, []
    for name in sorted(ckpt.weight_map):
        relative, scope = _scoped_name(ckpt, name)
        if relative is None:
            unknown.append(name)
            continue
        match = nm.match_ours(relative, text, scope)
        if match is None:
            unknown.append(name)
        else:
            matches[name] = match
    return matches, unknown


def _recorded_a_log_length(ckpt, heads: int):
    """{output layer: length} or one length for all layers, as `convert` recorded the source's A_log padding; None
    when the folder has no record (then export pads like the release)."""
    path = ckpt.root / files.PROVENANCE_NAME
    recorded = files.read_provenance(ckpt.root).get("release_a_log_length")
    values = recorded.values() if isinstance(recorded, dict) else [recorded]
    if recorded is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= heads for v in values):
        raise ConversionError(f"{path}: release_a_log_length {recorded!r} must be a length >= {heads} (the KDA heads) "
                              "or a map of layer -> length")
    return recorded


def _a_log_length(recorded, layer: int, default: int, ckpt) -> int:
    if recorded is None:
        return default
    if isinstance(recorded, int):
        return recorded
    if str(layer) not in recorded:
        raise ConversionError(f"{ckpt.root / files.PROVENANCE_NAME}: release_a_log_length has no entry for layer "
                              f"{layer}")
    return recorded[str(layer)]


def build_export_plan(ckpt, context: RunContext, experts_format: str = RELEASE_EXPERTS_FORMAT,
                      allow_unknown: bool = False) -> ExportPlan:
    """experts_format: the release's (its layout: re-quantised, or split when kept packed) or dense (per-expert bf16
    `.weight`; what `verify` compares against the source)."""
    experts_format = streamed_format(experts_format)
    text = ckpt.text_config
    symbols = nm.dims(text, ckpt.vision_config)
    matches, unknown = _classify_ours(ckpt)
    notes = []
    if unknown:
        if not allow_unknown:
            raise ConversionError(
                f"{ckpt.index_path}: {len(unknown)} tensor name(s) are not ours, e.g. `{unknown[0]}`; pass "
                "--allow-unknown to skip them"
            )
        notes.append(f"skipped {len(unknown)} unknown tensor(s), e.g. `{unknown[0]}`")
    our_prefix = TEXT_PREFIX if ckpt.composite else ""
    tensors: list[OutTensor] = []
    casts: dict[tuple[str, str], list[str]] = {}  # (from, to) -> tensor names; reported as one line per pair
    cache = _ExpertCache()
    requantised = False
    a_log_recorded = _recorded_a_log_length(ckpt, symbols["H"])

    def add_tensor(site: nm.Site):
        rule, our_name, release_name, why = site.rule, site.ours, site.release, site.why
        release_shape = nm.shape_of(rule.shape, symbols)
        ours_shape = release_shape
        if rule.transform == "unpad_heads":
            ours_shape = (symbols["H"],)
            release_shape = (_a_log_length(a_log_recorded, site.layer, symbols["A"], ckpt),)
            if a_log_recorded is None:
                notes.append(f"A_log padded to {symbols['A']} entries like the release: {files.PROVENANCE_NAME} "
                             "records no source length")
        if our_name not in ckpt.weight_map:
            raise ConversionError(f"{ckpt.index_path}: tensor `{our_name}` is missing from the index ({why})")
        entry = ckpt.entry(our_name)
        if tuple(entry.shape) != ours_shape:
            raise shard_error(ckpt.shard_path(ckpt.weight_map[our_name]),
                              f"expected shape {list(ours_shape)} ({why}), found {list(entry.shape)}", our_name)
        dtype = DTYPES[rule.dtype]
        if entry.dtype != rule.dtype:
            casts.setdefault((entry.dtype, rule.dtype), []).append(our_name)
        if rule.transform == "unpad_heads":
            produce = pad_heads(ckpt, our_name, release_shape[0], dtype)
        elif entry.dtype != rule.dtype:
            produce = cast_tensor(ckpt, our_name, dtype)
        else:
            produce = copy_bytes(ckpt, our_name)
        tensors.append(OutTensor(OutSpec(release_name, rule.dtype, release_shape), produce, our_name, site.group))

    def add_experts(site: nm.Site):
        nonlocal requantised
        rule, ours, why = site.rule, site.ours, site.why
        packed = ours + FUSED_PACKED in ckpt.weight_map
        stored = RELEASE if packed else DENSE
        requantised = requantised or (experts_format is RELEASE and not packed)
        if not packed and ours not in ckpt.weight_map:
            raise ConversionError(f"{ckpt.index_path}: tensor `{ours}` (or `{ours}{FUSED_PACKED}`) is missing ({why})")
        logical = [nm.shape_of(rule.part_shape, symbols) for _ in rule.parts]
        rows, cols = sum(s[0] for s in logical), logical[0][1]
        expected = {ours + FUSED_PACKED: (symbols["E"], rows, cols // 2),
                    ours + FUSED_SCALE: (symbols["E"], rows, cols // MXFP4_GROUP_SIZE)} if packed else \
            {ours: (symbols["E"], rows, cols)}
        for name, shape in expected.items():
            entry = ckpt.entry(name)
            if tuple(entry.shape) != shape or (packed and entry.dtype != "U8"):
                raise shard_error(ckpt.shard_path(ckpt.weight_map[name]),
                                  f"expected {'U8 ' if packed else ''}{list(shape)} ({why}), found "
                                  f"{entry.dtype} {list(entry.shape)}", name)
        for expert in range(symbols["E"]):
            row = 0
            for part, (out_dim, in_dim) in zip(rule.parts, logical):
                rows_range = (row, row + out_dim)
                row += out_dim
                if experts_format is DENSE:
                    outputs = ((PLAIN, "BF16", (out_dim, in_dim)),)
                else:
                    packed_shape, scale_shape = packed_shapes((out_dim, in_dim))
                    outputs = ((PACKED, "U8", packed_shape), (SCALE, "U8", scale_shape))
                for suffix, dtype, shape in outputs:
                    produce = export_expert_part(ckpt, ours, stored, expert, rows_range, suffix, cache, context)
                    tensors.append(OutTensor(OutSpec(f"{site.release_expert(expert, part)}.{suffix}", dtype, shape),
                                             produce, f"{ours}[{expert}, {rows_range[0]}:{rows_range[1]}]",
                                             site.group))

    has_vision = any(getattr(m.rule, "scope", "text") == "vision" for m in matches.values())
    layers = list(range(text.num_hidden_layers))
    for site in nm.walk(text, symbols, layers, TEXT_PREFIX, our_prefix, has_vision):
        (add_experts if isinstance(site.rule, nm.ExpertRule) else add_tensor)(site)
    notes += [cast_note(names, source, target) for (source, target), names in casts.items()]
    return ExportPlan(tensors, notes, requantised)


def cast_note(names: list[str], source: str, target: str) -> str:
    """One line for every tensor cast between the same pair of dtypes (a fine-tune saved in f32 casts most of them)."""
    shown = ", ".join(f"`{name}`" for name in names[:2])
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    return f"{len(names)} tensor(s) cast from {source} to the release's {target}: {shown}{more}"


def materialise(tensor: OutTensor) -> torch.Tensor:
    """The whole tensor in memory (verify, tests): the producer's chunks joined and viewed with the planned layout."""
    chunks = [c.contiguous().reshape(-1).view(torch.uint8) for c in tensor.produce()]
    data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return data.view(DTYPES[tensor.spec.dtype]).reshape(tensor.spec.shape)


def total_bytes(tensors) -> int:
    return sum(t.spec.nbytes for t in tensors)


__all__ = [
    "ConvertOptions", "ConvertPlan", "ExportPlan", "OutTensor", "RunContext", "build_convert_plan",
    "build_export_plan", "materialise", "total_bytes",
]
