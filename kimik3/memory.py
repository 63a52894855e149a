"""The cache-memory table of `kimik3 memory`: K3's hybrid cache vs the same depth all-MLA vs expanded K/V.
(Activation memory during training is `kimik3.training.activations`.)"""

import functools
import math
import os
import re
from pathlib import Path


def _text_config_of(data: dict):
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

    return KimiK3Config(**data).text_config if "text_config" in data else KimiK3TextConfig(**data)


def load_text_config(path: str | Path | None = None):
    """The text config of a config.json (the release's top-level schema or a text config); the release's when
    `path` is None. A file that cannot be used raises ValueError naming it."""
    from kimik3.configuration import released_config_dict

    if path is None:
        return _text_config_of(released_config_dict())
    from kimik3.modeling.files_kimi_k3 import read_json

    if Path(path).is_dir():
        raise ValueError(f"{path}: is a folder; give the path of its config.json")
    if not os.path.lexists(path):
        raise ValueError(f"{path}: no such file")
    # a regular file only (a FIFO would wait for a writer forever), nesting the parser can take
    data = read_json(path, error=lambda where, message: ValueError(f"{where}: cannot be read as JSON: {message}"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, not a {type(data).__name__}")
    try:
        return _text_config_of(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def memory_table(config, context_lengths=(131072, 1048576), batch_size: int = 1, dtype_bytes: int = 2,
                 state_dtype: str = "float32") -> list[dict]:
    """Cache bytes: K3 (latent MLA + KDA state + conv) vs the same depth all-MLA (latent) vs the official remote
    code (expanded K/V per MLA layer). The model keeps the KDA state in float32; `state_dtype="bfloat16"` gives what
    a 2-byte state would take (the unit some published estimates use)."""
    from kimik3.modeling.cache_kimi_k3 import analytic_cache_bytes

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = len(text.layer_types)
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    expanded_per_token = text.num_attention_heads * (text.qk_head_dim + text.v_head_dim)
    rows = []
    for tokens in context_lengths:
        k3 = analytic_cache_bytes(text, tokens, batch_size, dtype_bytes)
        state = k3["kda_state"] * STATE_DTYPE_BYTES[state_dtype] // 4  # the analytic count is for the f32 state
        rows.append(
            {
                "tokens": tokens,
                "batch": batch_size,
                "state_dtype": state_dtype,
                "k3_mla_kv": k3["mla_kv"],
                "k3_kda_state": state,
                "k3_kda_conv": k3["kda_conv"],
                "k3_total": k3["mla_kv"] + state + k3["kda_conv"],
                "all_mla_latent": num_layers * tokens * text.mla_cache_dim * dtype_bytes * batch_size,
                "official_expanded_kv": num_mla * tokens * expanded_per_token * dtype_bytes * batch_size,
            }
        )
    return rows


def describe_layers(config) -> str:
    num_layers = len(config.layer_types)
    num_mla = sum(t == "full_attention" for t in config.layer_types)
    return f"{num_layers} layers ({num_layers - num_mla} KDA, {num_mla} MLA)"


UNITS = {"GB": 10**9, "GiB": 2**30, "MB": 10**6, "MiB": 2**20, "kB": 10**3, "KiB": 2**10}
UNIT_WORDS = {"GB": "10^9 bytes", "GiB": "2^30 bytes", "MB": "10^6 bytes", "MiB": "2^20 bytes", "kB": "10^3 bytes",
              "KiB": "2^10 bytes"}
TABLE_COLUMNS = ("k3_mla_kv", "k3_kda_state", "k3_kda_conv", "k3_total", "all_mla_latent", "official_expanded_kv")


def auto_unit(rows: list[dict]) -> str:
    """GiB, MiB or KiB: the largest in which every non-zero figure of the table shows at least 0.01 (so a tiny
    model's table is not all zeros)."""
    smallest = min((r[c] for r in rows for c in TABLE_COLUMNS if r[c]), default=0)
    for unit in ("GiB", "MiB"):
        if smallest >= 0.01 * UNITS[unit]:
            return unit
    return "KiB"


def format_memory_table(rows: list[dict], unit: str = "GiB") -> str:
    scale = UNITS[unit]
    cell = lambda n: f"{n / scale:,.3f} {unit}"  # noqa: E731
    width = max([13] + [len(cell(r[c])) for r in rows for c in TABLE_COLUMNS])
    names = ("K3 MLA KV", "K3 KDA state", "K3 conv", "K3 total", "all-MLA", "expanded K/V")
    h = [f"{name:>{width}}" for name in names]
    header = f"{'tokens':>9} {'batch':>5} | {h[0]} {h[1]} {h[2]} {h[3]} | {h[4]} | {h[5]}"
    lines = [header, "-" * len(header)]
    for r in rows:
        c = [f"{cell(r[name]):>{width}}" for name in TABLE_COLUMNS]
        lines.append(f"{r['tokens']:>9} {r['batch']:>5} | {c[0]} {c[1]} {c[2]} {c[3]} | {c[4]} | {c[5]}")
    return "\n".join(lines)


# Figures quoted for K3 elsewhere, in decimal GB with a 2-byte KDA state and mixed token counts (128K = 128,000; 1M =
# 2^20 for the MLA figure but 10^6 for the all-MLA one); `kimik3 memory --reconcile` recomputes each from the config.
# (quoted figure, what, table column, the context it was quoted at, the tokens that reproduce it)
QUOTED_FIGURES = (
    ("0.22 GB", "KDA state", "k3_kda_state", "any context", 128_000),
    ("3.5 GB", "MLA latent KV", "k3_mla_kv", "128K", 128_000),
    ("29 GB", "MLA latent KV", "k3_mla_kv", "1M", 1_048_576),
    ("13.7 GB", "all-MLA latent KV", "all_mla_latent", "128K", 128_000),
    ("107 GB", "all-MLA latent KV", "all_mla_latent", "1M", 1_000_000),
)
RECONCILE_TOKENS = (128_000, 1_000_000, 1_048_576)


def reconcile_quoted(config) -> list[dict]:
    """Each quoted figure recomputed under its own assumptions (its token count, a bf16 state), whether it rounds to
    the quote, and the same entry of the default table (K = 1024 tokens, the f32 state the model keeps)."""
    out = []
    for figure, what, column, context, tokens in QUOTED_FIGURES:
        theirs = memory_table(config, (tokens,), state_dtype="bfloat16")[0][column]
        ours_tokens = 131_072 if context == "128K" else 1_048_576
        ours = memory_table(config, (ours_tokens,))[0][column]
        number = figure.split()[0]
        matches = round(theirs / 1e9, len(number.partition(".")[2])) == float(number)
        out.append({"quoted": figure, "what": what, "column": column, "context": context, "tokens": tokens,
                    "bytes": theirs, "matches": matches, "default_table_tokens": ours_tokens,
                    "default_table_bytes": ours})
    return out


def format_reconciliation(lines: list[dict]) -> str:
    out = ["Quoted figures recomputed (GB = 10^9 bytes, GiB = 2^30 bytes; the default table: K = 1024 tokens, f32 "
           "KDA state):"]
    for r in lines:
        if r["column"] == "k3_kda_state":
            assumption = "with a 2-byte state, conv windows not counted"
            default = "f32 state"
        else:
            assumption = f"{r['context']} read as {r['tokens']:,} tokens"
            default = f"{r['default_table_tokens']:,} tokens"
        verdict = "matches" if r["matches"] else "DOES NOT MATCH"
        out.append(f"  {r['what']} {r['quoted']} ({r['context']}): {assumption} -> {r['bytes']:,} B = "
                   f"{r['bytes'] / 1e9:.3f} GB, {verdict}; the default table ({default}): "
                   f"{r['default_table_bytes'] / 1e9:.3f} GB = {r['default_table_bytes'] / 2**30:.3f} GiB")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# KDA state snapshots for prefix reuse (KimiK3Cache(snapshot_interval=...), the report's sparse checkpoints)


def snapshot_memory(config, context_lengths=(131072, 1048576), every_blocks: int | None = None,
                    batch_size: int = 1, dtype_bytes: int = 2) -> list[dict]:
    """Snapshot bytes: one snapshot (every KDA layer's f32 state + conv windows) and all of them over a context,
    one every `every_blocks` 512-token blocks (default: the cache's DEFAULT_SNAPSHOT_BLOCKS)."""
    from kimik3.modeling.cache_kimi_k3 import snapshot_bytes
    from kimik3.modeling.rewind_kimi_k3 import DEFAULT_SNAPSHOT_BLOCKS, KDA_BLOCK_SIZE

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    blocks = DEFAULT_SNAPSHOT_BLOCKS if every_blocks is None else every_blocks
    interval = blocks * KDA_BLOCK_SIZE
    per_snapshot = snapshot_bytes(text, batch_size, dtype_bytes)
    return [{"tokens": tokens, "batch": batch_size, "interval_tokens": interval, "snapshots": tokens // interval,
             "bytes_per_snapshot": per_snapshot, "snapshot_bytes": tokens // interval * per_snapshot}
            for tokens in context_lengths]


def format_snapshot_memory(rows: list[dict], unit: str = "GiB") -> str:
    scale = UNITS[unit]
    cell = lambda n: f"{n / scale:,.3f} {unit}"  # noqa: E731
    header = f"{'tokens':>9} {'batch':>5} | {'interval':>9} {'snapshots':>9} | {'per snapshot':>15} {'all':>15}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['tokens']:>9} {r['batch']:>5} | {r['interval_tokens']:>9} {r['snapshots']:>9} | "
                     f"{cell(r['bytes_per_snapshot']):>15} {cell(r['snapshot_bytes']):>15}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# `kimik3 memory --plan`: exact weight bytes from the config's parameter shapes, and a layer-wise device split

DTYPE_BYTES = {"bf16": 2, "f32": 4, "u8": 1, "i8": 1}
_DTYPE_TAGS = {"torch.bfloat16": "bf16", "torch.float32": "f32", "torch.uint8": "u8", "torch.int8": "i8"}
KIB_TOKENS = {"K": 2**10, "M": 2**20}
# The release's index `metadata.total_size` (docs/architecture.md, The release's files), and what of it is not the
# text model we build: the vision tower and projector (shards 96 and 95), and A_log's zero padding (96 real heads
# stored as 128, F32).
RELEASE_TOTAL_SIZE = 1_560_860_324_864
RELEASE_VISION_BYTES = 802_428_928 + 92_289_024
RELEASE_A_LOG_PADDING_BYTES = 69 * (128 - 96) * 4


def tensor_bytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * DTYPE_BYTES[dtype]


_RELEASE_DTYPE_TAGS = {"BF16": "bf16", "F32": "f32", "U8": "u8"}


def _layer_tensors(text, index: int, experts_format: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Layer `index`'s tensors (names relative to the layer) from the name map, the one parameter table that
    `kimik3 convert` and the release load read too (kimik3/name_map.py): the release's dtypes, our shapes (A_log
    without the release's padding), the routed experts as the format stores them (its own tensors, made on the meta
    device: their shapes and dtypes, no memory)."""
    import torch
    from kimik3 import name_map as nm

    symbols = nm.dims(text)
    prefix = nm.fill(nm.LAYER_PREFIX, L=index)
    tensors = {nm.fill(rule.ours, L=index).removeprefix(prefix): _rule_tensor(nm, rule, symbols)
               for rule in nm.expected_layer_rules(text, index)}
    fmt = _format(experts_format)
    for rule in nm.expected_layer_expert_rules(text, index):
        rows, cols = nm.shape_of(rule.part_shape, symbols)
        with torch.device("meta"):
            stored = fmt.empty((symbols["E"], rows * len(rule.parts), cols), torch.bfloat16)
        for suffix, tensor in zip(fmt.suffixes, stored):
            tensors[nm.fill(rule.ours, L=index).removeprefix(prefix) + suffix] = (
                tuple(tensor.shape), _DTYPE_TAGS[str(tensor.dtype)])
    return tensors


def _rule_tensor(nm, rule, symbols) -> tuple[tuple[int, ...], str]:
    shape = (symbols["H"],) if rule.transform == "unpad_heads" else nm.shape_of(rule.shape, symbols)
    return shape, _RELEASE_DTYPE_TAGS[rule.dtype]


def _format(experts_format: str):
    """The experts format object of that name (modeling_kimik3/experts_format_kimi_k3.py)."""
    from kimik3.modeling.experts_format_kimi_k3 import experts_format as format_named

    return format_named(experts_format)


def _experts_format(experts_format: str | None) -> str:
    """The config's vocabulary (configuration_kimi_k3.EXPERTS_FORMATS); None is the release's own format."""
    from kimik3.modeling.configuration_kimi_k3 import RELEASE_EXPERTS_FORMAT, check_experts_format

    return RELEASE_EXPERTS_FORMAT if experts_format is None else check_experts_format(experts_format)


def weight_units(config, experts_format: str | None = None
                 ) -> list[tuple[str, dict[str, tuple[tuple[int, ...], str]]]]:
    """The text model's stored tensors, from the config alone, grouped in placement order: `embed`, `layers.0` ...,
    `head` (output AttnRes mix, final norm, lm_head). Each tensor is (shape, dtype) as it loads in bf16: the release's
    F32 tensors stay F32, packed MXFP4 experts are uint8 codes (two per byte) plus one E8M0 byte per 32 values.
    `experts_format`: "mxfp4" (packed) or "dense" (bf16); None, the release's (mxfp4)."""
    experts_format = _experts_format(experts_format)
    from kimik3 import name_map as nm

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    symbols = nm.dims(text)
    model_level = {rule.ours: _rule_tensor(nm, rule, symbols) for rule in nm.expected_model_rules(text)}
    embed = "model.embed_tokens.weight"
    units = [("embed", {embed: model_level.pop(embed)})]
    for index in range(len(text.layer_types)):
        layer = _layer_tensors(text, index, experts_format)
        units.append((f"layers.{index}", {f"model.layers.{index}.{name}": spec for name, spec in layer.items()}))
    units.append(("head", model_level))
    return units


def unit_bytes(tensors: dict[str, tuple[tuple[int, ...], str]]) -> int:
    return sum(tensor_bytes(shape, dtype) for shape, dtype in tensors.values())


def weight_bytes(config, experts_format: str | None = None) -> int:
    return sum(unit_bytes(tensors) for _, tensors in weight_units(config, experts_format))


def parse_gpu_memory(text: str) -> int:
    """'141GB' (10^9 bytes), '141GiB' (2^30 bytes), also KB/MB/KiB/MiB or a plain byte count, through transformers'
    size helper. The unit is read case-insensitively; bits ('Gb') are not accepted. Raises ValueError."""
    from transformers.utils.hub import convert_file_size_to_int

    value = text.strip()
    match = re.fullmatch(r"(\d+)\s*([KMG]i?B)?", value, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size: give a whole number with a unit, e.g. 141GB (141*10^9 bytes) "
                         "or 141GiB (141*2^30 bytes)")
    number, unit = match.groups()
    # uppercase: transformers reads a trailing lowercase 'b' as bits
    size = int(number) if unit is None else convert_file_size_to_int(number + unit.upper())
    if size < 1:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return size


def parse_tokens(text: str) -> int:
    """A token count: '131072', '128K' (K = 1024) or '1M' (M = 1024^2). Raises ValueError."""
    value = text.strip()
    scale = KIB_TOKENS.get(value[-1:].upper(), 1)
    number = value[:-1] if scale != 1 else value
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"{text!r} is not a token count: give a whole number >= 1, optionally with K (x1024) or M "
                         "(x1024^2), e.g. 128K or 1M")
    return int(number) * scale


def unit_cache_bytes(config, units: list[str], tokens: int, batch_size: int, dtype_bytes: int = 2) -> list[int]:
    """Cache bytes of each placement unit: a layer's MLA latents or KDA state + conv windows live on its device."""
    from kimik3.modeling.cache_kimi_k3 import analytic_cache_bytes

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    totals = analytic_cache_bytes(text, tokens, batch_size, dtype_bytes)
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    num_kda = len(text.layer_types) - num_mla
    # every layer of a kind holds the same cache, so the totals split evenly
    per_mla = totals["mla_kv"] // num_mla if num_mla else 0
    per_kda = (totals["kda_state"] + totals["kda_conv"]) // num_kda if num_kda else 0
    out = []
    for name in units:
        if not name.startswith("layers."):
            out.append(0)
        else:
            out.append(per_mla if text.layer_types[int(name.split(".")[1])] == "full_attention" else per_kda)
    return out


def _split_contiguous(loads: list[int], capacity: int) -> list[list[int]]:
    """Greedy contiguous split: each device takes units in order while they fit in `capacity` (the fewest devices
    for a given capacity; every unit must fit alone)."""
    parts, current, used = [], [], 0
    for index, load in enumerate(loads):
        if current and used + load > capacity:
            parts.append(current)
            current, used = [], 0
        current.append(index)
        used += load
    return parts + [current] if current else parts


def _balanced_split(loads: list[int], devices: int) -> list[list[int]]:
    """The contiguous split over at most `devices` parts with the smallest largest part (binary search on it)."""
    low, high = max(loads), sum(loads)
    while low < high:
        middle = (low + high) // 2
        if len(_split_contiguous(loads, middle)) <= devices:
            high = middle
        else:
            low = middle + 1
    return _split_contiguous(loads, low)


def device_plan(config, gpus: int, gpu_memory: int, context: int, batch_size: int = 1,
                experts_format: str | None = None) -> dict:
    """Whole decoder layers per device in order (device_map with `no_split_module_classes=["KimiK3DecoderLayer"]`):
    embeddings with the first layers, the head with the last; each layer's cache on its layer's device. Balanced so
    the fullest device is as empty as possible. Activations and the CUDA context are not counted. `experts_format`
    as in `weight_units` (None: the release's mxfp4)."""
    experts_format = _experts_format(experts_format)
    units = weight_units(config, experts_format)
    names = [name for name, _ in units]
    weights = [unit_bytes(tensors) for _, tensors in units]
    caches = unit_cache_bytes(config, names, context, batch_size)
    loads = [w + c for w, c in zip(weights, caches)]
    devices = []
    for part in _balanced_split(loads, gpus):
        layers = [names[i] for i in part]
        weight, cache = sum(weights[i] for i in part), sum(caches[i] for i in part)
        devices.append({"units": layers, "weights": weight, "cache": cache, "left": gpu_memory - weight - cache})
    largest = max(loads)
    smallest = len(_split_contiguous(loads, gpu_memory)) if largest <= gpu_memory else None
    return {
        "gpus": gpus,
        "gpu_memory": gpu_memory,
        "context": context,
        "batch": batch_size,
        "experts_format": experts_format,
        "weights": sum(weights),
        "cache": sum(caches),
        "devices": devices,
        "fits": all(d["left"] >= 0 for d in devices),
        "largest_unit": {"name": names[loads.index(largest)], "bytes": largest},
        "smallest_gpus": smallest,
    }


def _describe_units(units: list[str]) -> str:
    layers = [int(u.split(".")[1]) for u in units if u.startswith("layers.")]
    parts = ["embed"] if "embed" in units else []
    if layers:
        parts.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
    if "head" in units:
        parts.append("head")
    return ", ".join(parts)


def format_device_plan(plan: dict, config, unit: str = "GB") -> str:
    scale = 10**9 if unit == "GB" else 2**30
    fmt = lambda n: f"{n / scale:,.2f} {unit}"  # noqa: E731
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = _format(plan["experts_format"]).summary
    lines = [
        f"Kimi K3 text model, {describe_layers(text)}, {text.num_experts} routed experts per MoE layer as {experts}; "
        "other weights bf16, the release's F32 tensors F32",
        f"context {plan['context']:,} tokens x batch {plan['batch']} (K = 1024, M = 1024^2 tokens); cache: MLA "
        "latents bf16, KDA states f32",
        f"units: GB = 10^9 bytes, GiB = 2^30 bytes; {plan['gpus']} device(s) x {fmt(plan['gpu_memory'])} "
        f"({plan['gpu_memory']:,} bytes)",
        f"weights {fmt(plan['weights'])} ({plan['weights']:,} bytes), cache {fmt(plan['cache'])} "
        f"({plan['cache']:,} bytes)",
        "",
        "layer-wise split (device_map: whole decoder layers per device, each layer's cache on its device):",
        f"{'device':>6}  {'holds':<22} {'weights':>14} {'cache':>14} {'left':>14}",
    ]
    for index, device in enumerate(plan["devices"]):
        lines.append(f"{index:>6}  {_describe_units(device['units']):<22} {fmt(device['weights']):>14} "
                     f"{fmt(device['cache']):>14} {fmt(device['left']):>14}")
    for index in range(len(plan["devices"]), plan["gpus"]):
        lines.append(f"{index:>6}  {'(unused)':<22} {fmt(0):>14} {fmt(0):>14} {fmt(plan['gpu_memory']):>14}")
    lines.append("")
    smallest = plan["smallest_gpus"]
    if smallest is None:
        need = (f"no number of devices fits: {plan['largest_unit']['name']} alone needs "
                f"{fmt(plan['largest_unit']['bytes'])} (split it with tensor or expert parallelism)")
    else:
        need = f"the smallest number of devices that fits is {smallest}"
    if plan["fits"]:
        least = min(d["left"] for d in plan["devices"])
        lines.append(f"verdict: FITS on {plan['gpus']} x {fmt(plan['gpu_memory'])}, at least {fmt(least)} left per "
                     f"device for activations and workspace (not counted here); {need}")
    else:
        worst = min(d["left"] for d in plan["devices"])
        lines.append(f"verdict: DOES NOT FIT on {plan['gpus']} x {fmt(plan['gpu_memory'])} (the fullest device is "
                     f"{fmt(-worst)} over); {need}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# `kimik3 memory --plan --nodes N --gpus-per-node G --tp T --ep E`: per-rank bytes of a parallel layout.
#
# The degrees mean what transformers' DistributedConfig means by them (the API the model loads through): --tp ranks
# split the dense tensors the model's tp_plan names (attention by head, dense and shared MLPs by width, lm_head by
# vocabulary); --ep ranks hold distinct whole experts (the ep_plan: Shard(0) of the expert stacks). transformers
# requires ep to be a multiple of tp (the EP group contains the TP group), and without EP the TP plan splits the
# routed experts by their intermediate width. The ranks of one model replica are max(tp, ep); the remaining factor of
# the world size is a pipeline split by whole decoder layers, as the one-process device_map plan splits them.

# the prompt tokens one prefill forward takes when a plan is not told (`--prefill-chunk`), for its workspace
DEFAULT_PREFILL_CHUNK = 8192
H200_HBM_BANDWIDTH = 4.8e12  # bytes/s: the H200's HBM3e specification (docs/benchmarks.md measures 4.3e12 copies)
# Styles of the tp plan that split a tensor, and the dimension they split (a Linear weight is [out, in]; an expert
# stack [E, out, in]; an embedding [vocab, hidden]): colwise splits out, rowwise in, the head style the leading (head) axis. Every other style
# (replicated_with_grad_allreduce, mla_kv_a_proj, moe_tp_experts) leaves the tensor whole on every rank.
TP_SPLIT_DIM = {"embedding_rowwise": 0, "embedding_colwise": -1, "colwise": -2, "packed_colwise": -2, "colwise_gather_output": -2, "rowwise": -1, "kimi_k3_heads": 0}


class PlanError(ValueError):
    """A parallel layout the model cannot take; the message names the option and the tensor or size at fault."""


@functools.cache
def _tp_styles() -> dict[str, str]:
    """The tensor-parallel plan transformers applies to the model (its config's base plan under `model.`, the
    head's class plan, and what this transformers adds itself: 5.24 shards the input embeddings by vocabulary),
    read from a model built on the meta device: the patterns do not depend on the widths."""
    import torch

    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    with torch.device("meta"):
        return dict(KimiK3ForCausalLM(KimiK3TextConfig(**tiny_text_config_dict()))._tp_plan)  # cached: read-only


def _style_of(name: str, styles: dict[str, str]) -> str | None:
    """The tp-plan style of a stored tensor: a pattern naming the tensor itself or the module that owns it."""
    return _style_of_layer_name(re.sub(r"\.layers\.\d+\.", ".layers.0.", name), tuple(styles.items()))


@functools.cache
def _style_of_layer_name(name: str, styles: tuple[tuple[str, str], ...]) -> str | None:
    for pattern, style in styles:
        regex = re.escape(pattern).replace(r"\*", r"\d+")
        if re.fullmatch(regex + r"(\.[A-Za-z_]+)?", name):
            return style
    return None


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _shard_shape(name: str, shape: tuple[int, ...], tp: int, ep: int, styles: dict[str, str]
                 ) -> tuple[tuple[int, ...], str | None]:
    """(this rank's shape, the degree that split it: "tp", "ep" or None). Routed experts: by expert under EP, else by
    width under TP (packed codes and scales split along the same axis as the weights they encode)."""
    if _is_routed_expert(name):
        if ep > 1:
            return (shape[0] // ep, *shape[1:]), "ep"
        base = name.removesuffix("_packed").removesuffix("_scale")
        style = _style_of(base, styles)
    else:
        style = _style_of(name, styles)
    if tp == 1 or style not in TP_SPLIT_DIM:
        return shape, None
    dim = TP_SPLIT_DIM[style] % len(shape)
    if shape[dim] % tp:
        raise PlanError(f"argument --tp: {tp} does not divide {name} {list(shape)} on dimension {dim} "
                        f"({shape[dim]:,}; the tp plan splits it '{style}')")
    return tuple(s // tp if i == dim else s for i, s in enumerate(shape)), "tp"


def check_degrees(config, world: int, tp: int, ep: int) -> int:
    """The layout's product rules; returns the pipeline stages (world / ranks of one replica). PlanError names the
    option and the count it must divide."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if ep > 1 and ep % tp:
        raise PlanError(f"argument --ep: {ep} is not a multiple of --tp {tp} (transformers' expert-parallel group "
                        "contains the tensor-parallel group; --ep 1 splits the experts by width under --tp)")
    group = max(tp, ep)
    if world % group:
        raise PlanError(f"argument --{'ep' if ep >= tp else 'tp'}: {group} ranks a model replica do not divide the "
                        f"world size {world} (--nodes x --gpus-per-node)")
    if text.num_experts and text.num_experts % ep:
        raise PlanError(f"argument --ep: {ep} does not divide num_experts={text.num_experts}")
    for key in ("num_attention_heads", "linear_num_heads"):
        if getattr(text, key) % tp:
            raise PlanError(f"argument --tp: {tp} does not divide {key}={getattr(text, key)} (attention is split by "
                            "head)")
    return world // group


def runnable(nodes: int, world: int, tp: int, ep: int, stages: int, experts_format: str) -> str | None:
    """None when this version runs the layout, else why not (the load refuses it, or nothing builds it)."""
    if stages > 1 and (max(tp, ep) > 1 or nodes > 1):
        return ("whole-layer stages across processes: K3 has no pipeline plan (its layers split inside one process "
                "with device_map)")
    if ep > tp > 1:
        return ("ep > tp > 1: transformers needs fsdp_size = ep / tp and token all-to-all for it, not wired for K3")
    return None


def rank_weights(config, tp: int, ep: int, experts_format: str | None = None) -> list[dict]:
    """Per placement unit (embed, layers.i, head), the bytes one rank of a replica holds: `dense_split` (tensors the
    tp plan splits), `replicated` (whole on every rank) and `experts` (the routed experts' share)."""
    styles = _tp_styles() if tp > 1 else {}  # one rank of TP splits nothing
    out, seen = [], {}
    for unit, tensors in weight_units(config, experts_format):
        prefix = f"model.{unit}." if unit.startswith("layers.") else ""
        # layers of one kind hold the same tensors: their split is computed once (names as of layer 0)
        kind = tuple((f"model.layers.0.{n[len(prefix):]}" if prefix else n, shape, dtype)
                     for n, (shape, dtype) in tensors.items())
        if kind not in seen:
            parts = {"dense_split": 0, "replicated": 0, "experts": 0}
            for name, shape, dtype in kind:
                local, split = _shard_shape(name, shape, tp, ep, styles)
                key = "experts" if _is_routed_expert(name) else ("dense_split" if split else "replicated")
                parts[key] += tensor_bytes(local, dtype)
            seen[kind] = parts
        out.append({"unit": unit, **seen[kind], "total": sum(seen[kind].values())})
    return out


def rank_cache(config, units: list[str], tokens: int, batch_size: int, tp: int, dtype_bytes: int = 2) -> list[int]:
    """Cache bytes one rank holds per unit. MLA: the latent (kv_lora_rank + rope) a token, whole on every TP rank
    (kv_a_proj_with_mqa is replicated, each rank caches what it computed). KDA: state and conv windows by head,
    split by --tp with the heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    whole = unit_cache_bytes(text, units, tokens, batch_size, dtype_bytes)
    return [c // tp if n.startswith("layers.") and text.layer_types[int(n.split(".")[1])] == "linear_attention"
            else c for n, c in zip(units, whole)]


def prefill_workspace(config, tp: int, ep: int, chunk: int, batch_size: int, context: int,
                      experts_format: str) -> dict[str, int]:
    """The largest transient of one rank while a prefill chunk of `chunk` tokens x `batch_size` runs (bf16
    activations), term by term; an estimate from the model's widths, not a measurement:
      stream: the residual stream, its layer input and output, and Block AttnRes's banked block sums (one
        hidden-wide tensor per block of attn_res_block_size layers);
      attention: the larger of MLA (this rank's queries, one expanded key/value block of mla_prefill_key_block
        cached tokens, f32 output and log-sum-exp merge) and KDA (q/k/v/g of this rank's heads, f32 output);
      moe: the routed tokens' copies (top-k), their gate/up and down activations at this rank's width, and, for
        packed experts, the packed prefill's own transient (`packed_prefill_transient`);
      head: the last token's logits in f32 (generation keeps one).
    The CUDA context, allocator fragmentation and compile graphs are not counted."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tokens = chunk * batch_size
    hidden, bf16 = text.hidden_size, 2
    blocks = -(-len(text.layer_types) // text.attn_res_block_size) if text.attn_res_block_size else 0
    stream = (3 + blocks) * tokens * hidden * bf16
    mla_heads, kda_heads = text.num_attention_heads // tp, text.linear_num_heads // tp
    kv_block = min(text.mla_prefill_key_block(chunk), max(context - chunk, chunk)) * batch_size
    # the expanded block: kv_b_proj's output (no-PE keys and values; the values stay a view of it) and the assembled
    # keys (no-PE part and the shared k_pe)
    expanded = kv_block * mla_heads * (text.qk_nope_head_dim + text.v_head_dim + text.qk_head_dim) * bf16
    mla = tokens * mla_heads * text.qk_head_dim * bf16 + expanded + 2 * tokens * mla_heads * (text.v_head_dim + 1) * 4
    kda = tokens * kda_heads * text.linear_head_dim * (4 * bf16 + 4)
    experts = text.num_experts // ep if ep > 1 else text.num_experts
    width = text.moe_intermediate_size // (1 if ep > 1 else tp)
    latent = text.latent_size
    routed = tokens * text.num_experts_per_token
    moe = routed * (latent + 3 * width) * bf16
    transient = PREFILL_TRANSIENTS.get(_format(experts_format).op)
    packed = transient(experts, width, latent, routed) if transient else 0
    head = batch_size * text.vocab_size * 4
    return {"stream": stream, "attention": max(mla, kda), "moe": moe + packed, "head": head,
            "total": stream + max(mla, kda) + moe + packed + head}


def packed_prefill_transient(experts: int, width: int, latent: int, routed: int) -> int:
    """The bytes the packed experts' prefill adds for `routed` routed rows over `experts` experts of intermediate
    `width` (kernels/mxfp4.py, `moe_experts_mxfp4`): up to MXFP4_GEMM_ROWS_PER_EXPERT rows per expert the byte
    GEMM's even/odd split of its input rows (gate_up's is the wider), beyond it one chunk of dequantised experts
    (at most MXFP4_DEQUANT_CHUNK_BYTES, at least one expert). The word GEMM, the default since 2026-12-08, makes no
    such copy; the split stays counted, an upper bound, until the word GEMM has run its GPU tests
    (docs/benchmarks.md, Packed MXFP4 prefill), so a plan also holds with `MXFP4_GEMM_WORDS` off."""
    from kimik3.kernels import mxfp4

    bf16 = 2
    if mxfp4.mxfp4_experts_path(routed, experts) != "dequantised":
        return routed * max(latent, width) * bf16
    per_expert = 3 * width * latent * bf16  # gate_up (2 x width) and down (width), dequantised
    return min(experts, mxfp4.dequantised_chunk_experts(2 * width, latent, bf16)) * per_expert


# The prefill workspace an experts op adds beyond the dense GEMMs' (by the op's FAST_OPS name)
PREFILL_TRANSIENTS = {"moe_experts_mxfp4": packed_prefill_transient}


def decode_bytes(config, weights: list[dict], units: list[str], cache: list[int], tp: int, ep: int,
                 batch_size: int, experts_format: str | None) -> int:
    """HBM bytes one rank reads in one decode step: its dense and replicated weights (of the embedding only the
    batch's rows), the routed experts the step's batch x top-k routes reach (spread evenly over the experts; at most
    all of this rank's), and its cache (KDA states read and written)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = 0
    for unit, w, c in zip(units, weights, cache):
        if unit == "embed":
            total += batch_size * text.hidden_size * 2
            continue
        total += w["dense_split"] + w["replicated"]
        if w["experts"]:
            touched = min(text.num_experts, batch_size * text.num_experts_per_token)
            total += w["experts"] * touched // text.num_experts
        is_kda = unit.startswith("layers.") and text.layer_types[int(unit.split(".")[1])] == "linear_attention"
        total += 2 * c if is_kda else c
    return total


def parallel_plan(config, nodes: int, gpus_per_node: int, gpu_memory: int, tp: int, ep: int, context: int,
                  batch_size: int = 1, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, experts_format: str | None = None,
                  hbm_bandwidth: float = H200_HBM_BANDWIDTH) -> dict:
    """Per rank of a `nodes x gpus_per_node` world under (tp, ep) and whole-layer stages over the rest: weights
    (split by the tp plan, experts by ep, the replicated rest), cache at `context`, the prefill chunk's workspace,
    what is left, and the decode step's HBM bound. Raises PlanError for a layout the product rules refuse."""
    experts_format = _experts_format(experts_format)
    world = nodes * gpus_per_node
    stages = check_degrees(config, world, tp, ep)
    weights = rank_weights(config, tp, ep, experts_format)
    units = [w["unit"] for w in weights]
    cache = rank_cache(config, units, context, batch_size, tp)
    workspace = prefill_workspace(config, tp, ep, min(prefill_chunk, context), batch_size, context, experts_format)
    loads = [w["total"] + c for w, c in zip(weights, cache)]
    parts = _balanced_split(loads, stages) if stages > 1 else [list(range(len(units)))]
    stage_rows, step_seconds = [], 0.0
    for part in parts:
        w = [weights[i] for i in part]
        c = [cache[i] for i in part]
        held = {key: sum(x[key] for x in w) for key in ("dense_split", "replicated", "experts", "total")}
        read = decode_bytes(config, w, [units[i] for i in part], c, tp, ep, batch_size, experts_format)
        left = gpu_memory - held["total"] - sum(c) - workspace["total"]
        stage_rows.append({"units": [units[i] for i in part], "weights": held, "cache": sum(c),
                           "workspace": workspace["total"], "left": left, "decode_bytes": read,
                           "decode_ms": read / hbm_bandwidth * 1e3})
        step_seconds += read / hbm_bandwidth  # the stages of one token run one after another
    for _ in range(len(parts), stages):
        stage_rows.append({"units": [], "weights": {k: 0 for k in ("dense_split", "replicated", "experts", "total")},
                           "cache": 0, "workspace": 0, "left": gpu_memory, "decode_bytes": 0, "decode_ms": 0.0})
    return {"nodes": nodes, "gpus_per_node": gpus_per_node, "world": world, "tp": tp, "ep": ep, "stages": stages,
            "ranks_per_stage": max(tp, ep), "gpu_memory": gpu_memory, "context": context, "batch": batch_size,
            "prefill_chunk": min(prefill_chunk, context), "experts_format": experts_format,
            "hbm_bandwidth": hbm_bandwidth, "workspace_terms": workspace, "stage_ranks": stage_rows,
            "fits": all(s["left"] >= 0 for s in stage_rows), "decode_step_ms": step_seconds * 1e3,
            "not_runnable": runnable(nodes, world, tp, ep, stages, experts_format)}


# The most devices `--plan` plans for: far beyond the 16 H200s the release needs, and small enough that a search
# over the degrees (divisor pairs of the device count) ends at once.
MAX_PLAN_DEVICES = 1 << 20


def search_degrees(config, nodes: int, gpus_per_node: int, gpu_memory: int, context: int, batch_size: int = 1,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK, experts_format: str | None = None,
                   hbm_bandwidth: float = H200_HBM_BANDWIDTH, tp: int | None = None, ep: int | None = None
                   ) -> tuple[dict | None, list[dict]]:
    """Every (tp, ep) the product rules allow (with a given one fixed), planned; the choice: a layout this version
    runs that fits, then one that fits (not runnable yet), then a runnable one that does not fit, each by the
    fastest decode bound, then the smaller tp (fewer all-reduces). Returns (the chosen plan or None, all the candidates' plans)."""
    world = nodes * gpus_per_node
    small = [d for d in range(1, math.isqrt(world) + 1) if world % d == 0]
    divisors = sorted(set(small + [world // d for d in small]))
    candidates = []
    for t in [tp] if tp is not None else divisors:
        for e in [ep] if ep is not None else [1] + [d for d in divisors if d > 1]:
            try:
                candidates.append(parallel_plan(config, nodes, gpus_per_node, gpu_memory, t, e, context, batch_size,
                                                prefill_chunk, experts_format, hbm_bandwidth))
            except PlanError:
                continue
    key = lambda p: (not p["fits"], p["not_runnable"] is not None, p["decode_step_ms"], p["tp"])  # noqa: E731
    return (min(candidates, key=key) if candidates else None), candidates


def format_parallel_plan(plan: dict, config, unit: str = "GB", chosen_from: int | None = None) -> str:
    scale = 10**9 if unit == "GB" else 2**30
    fmt = lambda n: f"{n / scale:,.2f} {unit}"  # noqa: E731
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = _format(plan["experts_format"]).summary
    ws = plan["workspace_terms"]
    lines = [
        f"Kimi K3 text model, {describe_layers(text)}, {text.num_experts} routed experts per MoE layer as {experts}",
        f"context {plan['context']:,} tokens x batch {plan['batch']} (K = 1024, M = 1024^2 tokens); prefill chunk "
        f"{plan['prefill_chunk']:,} tokens; units: GB = 10^9 bytes, GiB = 2^30 bytes",
        f"world {plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s) = {plan['world']} ranks x "
        f"{fmt(plan['gpu_memory'])}; tp {plan['tp']}, ep {plan['ep']} ({plan['ranks_per_stage']} ranks a replica), "
        f"{plan['stages']} whole-layer stage(s)",
        "per rank: dense = tensors the tp plan splits, repl. = whole on every rank, experts = the routed experts' "
        "share (by expert under ep, by width under tp alone); cache: MLA latents whole on every TP rank, KDA state "
        "split by head",
        f"workspace (prefill chunk, an estimate): stream {fmt(ws['stream'])}, attention {fmt(ws['attention'])}, "
        f"MoE {fmt(ws['moe'])}" + (" (with the packed prefill's own: its row split or one chunk of dequantised experts)"
                                   if _format(plan["experts_format"]).op in PREFILL_TRANSIENTS else "")
        + f", head {fmt(ws['head'])}",
        "",
        f"{'stage':>5}  {'holds':<22} {'dense':>11} {'repl.':>11} {'experts':>11} {'cache':>11} {'workspace':>11} "
        f"{'left':>11} {'decode':>10}",
    ]
    for index, s in enumerate(plan["stage_ranks"]):
        w = s["weights"]
        lines.append(f"{index:>5}  {_describe_units(s['units']) or '(unused)':<22} {fmt(w['dense_split']):>11} "
                     f"{fmt(w['replicated']):>11} {fmt(w['experts']):>11} {fmt(s['cache']):>11} "
                     f"{fmt(s['workspace']):>11} {fmt(s['left']):>11} {s['decode_ms']:>7.2f} ms")
    lines.append("")
    lines.append(f"decode step bound: {plan['decode_step_ms']:.2f} ms at batch {plan['batch']} (each rank's bytes / "
                 f"{plan['hbm_bandwidth'] / 1e12:.2f} TB/s HBM; 4.80 = the H200's specification, stages one after "
                 "another; communication not counted)")
    least = min(s["left"] for s in plan["stage_ranks"])
    verdict = (f"verdict: FITS, at least {fmt(least)} left per rank" if plan["fits"] else
               f"verdict: DOES NOT FIT (the fullest rank is {fmt(-least)} over)")
    lines.append(verdict + "; " + ("runnable with this version" if plan["not_runnable"] is None else
                                   f"not runnable with this version: {plan['not_runnable']}"))
    if chosen_from is not None:
        lines.append(f"chosen from {chosen_from} layouts the product rules allow: one that fits first, a runnable "
                     "one before one this version cannot run, then the fastest decode bound, then the smaller tp")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# `kimik3 memory --plan --experts-offload host|disk`: the routed experts in host memory (or on disk, mapped from the
# shards, with what the page cache keeps of them), the rest on one GPU, and the device's expert cache (docs/design.md,
# Routed experts off the device) sized by what is left.

# bytes/s host -> device: an ASSUMPTION, not a measurement. The H200 hangs off PCIe 5.0 x16 (64 GB/s a direction
# before protocol overhead); pinned copies on such hosts reach about 50 GB/s. Measure yours and pass --h2d-bandwidth.
H2D_BANDWIDTH_ASSUMED = 50e9
# bytes/s disk -> host for `--experts-offload disk`: an ASSUMPTION, not a measurement. One PCIe 4.0 x4 NVMe SSD's
# rated sequential read (7 GB/s; PCIe 5.0 drives rate 12-14 GB/s, several drives in RAID 0 add up). An expert is read
# as a few runs of megabytes (its stacks' rows, or the release's per-expert tensors), so the sequential figure is the
# one that applies. Measure yours and pass --disk-bandwidth.
DISK_BANDWIDTH_ASSUMED = 7e9
H200_BF16_FLOPS = 989e12  # the H200's dense bf16 tensor-core peak (specification), for the prefill compute bound
# The CPU computing the routed experts the GPU lacks (`experts_compute`): ASSUMPTIONS until `--measure` times them.
# Bytes/s of the host kernel over packed experts with one token each (a memory-bound pass: a server socket's DRAM
# reads 300-600 GB/s, a kernel reaches a fraction of it), and flop/s with many tokens each (compute-bound).
HOST_EXPERTS_BYTES_ASSUMED = 100e9
HOST_EXPERTS_FLOPS_ASSUMED = 2e12
# The host kernel's rate as a fraction of the host's DRAM read rate, for a plan told the DRAM bandwidth of another
# host (`--host-bandwidth`) without measuring it: what the kernel reached at one token an expert on an H100's 16-core
# host (docs/benchmarks.md, "Routed experts computed on the host's CPU"); `--measure` replaces it with this machine's.
HOST_KERNEL_FRACTION_ASSUMED = 0.53
# A decode step with the routed experts off the device runs in the decode loop piecewise: the GPU's side is captured
# between the host's reads of each MoE layer's routes (generate_kimi_k3's `piecewise_decode_step`), and at each read
# the GPU idles while the host reads the routes, moves or hands off the experts, replays the next pieces and launches
# the device's share of the routed experts eagerly. Seconds one MoE layer adds so beyond the GPU's own time: an
# ASSUMPTION, (the piecewise step with every expert held on the GPU - the slice's step captured whole) / MoE layers,
# (8.22..8.61 - 3.94) / 3 ms on an H100's host (docs/benchmarks.md, "The decode loop captured piece by piece");
# `--piecewise-layer-ms` gives yours. The model's "auto" weighs the same figure (HostRates.read_layer_s; a test holds
# the two equal, as for the stream's and the rates above).
PIECEWISE_LAYER_S_ASSUMED = 1.5e-3
# A decode step whose routes are computed on the CPU in the stream's order (experts_compute "host", or "auto" where
# the CPU is faster; host_experts_kimi_k3's `StreamedRoutes`) reads no route on the host: the loop captures it whole,
# and each MoE layer adds the stream's own cost beside the kernel (the copies of its rows and routes, the host
# function's start, the outputs' copy back, the sums). Seconds a MoE layer: an ASSUMPTION, (the streamed step with
# every expert placed on the GPU, so the host computes nothing - the slice's step captured whole) / MoE layers,
# (4.381 - 4.068) / 3 ms on an H100's host (docs/benchmarks.md, "The routes computed in the stream's order");
# `--stream-layer-ms` gives yours.
STREAM_LAYER_S_ASSUMED = 0.104e-3
# Seconds a MoE layer whose missing experts run on the CPU spends on the route itself, beyond the kernel (the split,
# the rows crossing to host memory, the worker's hand-off, the outputs back and the sums): an ASSUMPTION, measured by
# bench_offload's split section on the same host (same section of docs/benchmarks.md); `--host-route-ms` gives yours.
HOST_ROUTE_S_ASSUMED = 1.1e-3
# What a plan keeps free on the GPU beyond the weights, the cache, the workspace and the expert cache: the CUDA
# context (torch's on an H100/H200 takes about 0.5 GB; 1 GB reserved) and the caching allocator's slack between
# blocks (a fraction of the device). ASSUMPTIONS, stated in the plan's GPU line.
CUDA_CONTEXT_RESERVE = 10**9
ALLOCATOR_RESERVE_FRACTION = 0.02


def expected_moved_experts(num_experts: int, top_k: int, tokens: int, cached: int) -> float:
    """Expected experts one layer moves in a forward of `tokens` tokens when its cache holds `cached` experts: the
    chosen ones it lacks. Under uniform routing the cache's contents (whatever its policy) are independent of this
    forward's choice, so each chosen expert is cached with probability cached / num_experts (once the cache is
    full: the steady state of a long decode)."""
    cached = min(cached, num_experts)
    from kimik3.modeling.host_experts_kimi_k3 import expected_distinct_experts

    return expected_distinct_experts(num_experts, top_k, tokens) * (1 - cached / num_experts)


def _active_matmul_params(config, experts_format: str) -> tuple[int, int]:
    """(the parameters a token multiplies by outside the routed experts, one routed expert's parameters): weight
    matrices of the layers and lm_head, not the embedding (a lookup) nor norms and biases."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dense = 0
    for unit, tensors in weight_units(config, "dense"):
        for name, (shape, _) in tensors.items():
            if unit != "embed" and len(shape) == 2 and not _is_routed_expert(name):
                dense += shape[0] * shape[1]
    return dense, 3 * text.moe_intermediate_size * text.latent_size


def offload_plan(config, gpu_memory: int, host_memory: int, context: int, batch_size: int = 1,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, experts_format: str | None = None,
                 experts_cache: int | None = None,
                 h2d_bandwidth: float = H2D_BANDWIDTH_ASSUMED, hbm_bandwidth: float = H200_HBM_BANDWIDTH,
                 bf16_flops: float = H200_BF16_FLOPS, mode: str = "host",
                 disk_bandwidth: float = DISK_BANDWIDTH_ASSUMED, experts_compute: str = "device",
                 host_bytes_per_s: float = HOST_EXPERTS_BYTES_ASSUMED,
                 host_flops: float = HOST_EXPERTS_FLOPS_ASSUMED, measured: dict | None = None,
                 piecewise_layer_s: float = PIECEWISE_LAYER_S_ASSUMED,
                 host_route_s: float = HOST_ROUTE_S_ASSUMED, stream_layer_s: float = STREAM_LAYER_S_ASSUMED) -> dict:
    """One GPU with the routed experts in host memory (`from_pretrained(..., experts_offload="host",
    experts_cache_bytes=...)`): the GPU holds every other weight, the cache at `context`, the prefill chunk's
    workspace plus the compact stack of one layer's chosen experts (a prefill chooses up to all of them), and the
    expert cache: `experts_cache` bytes, default all that is left. Raises PlanError for a cache the GPU cannot hold
    or one below the load's minimum (one expert per MoE layer).
    Decode step bound = routed bytes moved / h2d_bandwidth + the GPU's own HBM bound + MoE layers x
    `piecewise_layer_s` (the decode loop's step is captured between the routes' reads; each read costs that; not
    paid where the routes are computed on the CPU in the stream's order, below), no overlap counted; bytes moved =
    MoE layers x expected_moved_experts(batch) x bytes of one expert. Prefill chunk bound: the larger of
    its transfer (each layer's chosen experts cross once, expected_moved_experts(chunk x batch)) and its compute
    at bf16 peak (2 x active matmul parameters a token; attention's score products not counted).

    mode "disk" (`experts_offload="disk"`): the experts stay in the shards, mapped; `host_memory` is what the OS page
    cache may keep of them (0: none). A moved expert is in the page cache with probability page_cache / experts
    (uniform routing, as for the device cache); the others are read from the disk first, so a moved byte costs
    1 / h2d_bandwidth + (1 - that fraction) / disk_bandwidth (no overlap counted).

    experts_compute (the load option): "device" copies the missing experts as above; "host" computes them on the CPU,
    a layer's share taking max(bytes / host_bytes_per_s, routes x 2 x expert parameters / host_flops) plus its
    routes' inputs and outputs crossing PCIe plus the route's own `host_route_s` (a page-cache miss of the disk tier
    adds its disk read), or for a forward of up to STREAM_MAX_TOKENS tokens with the experts in host memory (mode
    "host": decode) `stream_layer_s` instead, its routes computed in the stream's order with no read by the host;
    "auto" takes the faster of the two per forward, as the load's HostRates do. `measured`: what `measure_rates` timed, recorded
    in the plan. The GPU keeps CUDA_CONTEXT_RESERVE + ALLOCATOR_RESERVE_FRACTION of its memory free."""
    from kimik3.modeling.host_experts_kimi_k3 import STREAM_MAX_TOKENS, expected_distinct_experts
    from kimik3.modeling.offload_kimi_k3 import EXPERTS_COMPUTE_MODES, EXPERTS_OFFLOAD_MODES

    if experts_compute not in EXPERTS_COMPUTE_MODES:
        raise PlanError(f"argument --experts-compute: {experts_compute!r} is not one of {list(EXPERTS_COMPUTE_MODES)}")
    if mode not in EXPERTS_OFFLOAD_MODES:
        raise PlanError(f"argument --experts-offload: {mode!r} is not one of {list(EXPERTS_OFFLOAD_MODES)}")
    experts_format = _experts_format(experts_format)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    weights = rank_weights(config, 1, 1, experts_format)
    units = [w["unit"] for w in weights]
    moe_layers = sum(1 for w in weights if w["experts"])
    if not moe_layers:
        raise PlanError("argument --experts-offload: the model has no routed experts (no MoE layer)")
    experts_bytes = sum(w["experts"] for w in weights)
    per_expert = experts_bytes // (moe_layers * text.num_experts)
    rest = sum(w["total"] for w in weights) - experts_bytes
    cache = rank_cache(config, units, context, batch_size, 1)
    chunk = min(prefill_chunk, context)
    experts, top_k = text.num_experts, text.num_experts_per_token

    def device_transient(size: int) -> tuple[int, int]:
        """(the prefill workspace of a chunk, the compact stack of one layer's chosen experts beside it)."""
        ws = prefill_workspace(config, 1, 1, size, batch_size, context, experts_format)
        chosen = min(experts, math.ceil(expected_distinct_experts(experts, top_k, size * batch_size)))
        return ws["total"], chosen * per_expert

    workspace, compact = device_transient(chunk)
    reserve = CUDA_CONTEXT_RESERVE + int(ALLOCATOR_RESERVE_FRACTION * gpu_memory)
    after_weights = gpu_memory - rest - reserve
    left = after_weights - sum(cache) - workspace - compact
    minimum = moe_layers * per_expert
    if experts_cache is None:
        experts_cache = max(left, minimum)  # all that is left, at least the load's minimum (the verdict says)
    elif experts_cache < minimum:
        raise PlanError(f"argument --experts-cache: {experts_cache:,} bytes is less than one expert per MoE layer "
                        f"({moe_layers} layers x {per_expert:,} bytes = {minimum:,} bytes, the load's minimum)")
    elif experts_cache > after_weights:
        raise PlanError(f"argument --experts-cache: {experts_cache:,} bytes is more than the GPU holds beside the "
                        f"other weights ({max(after_weights, 0):,} of {gpu_memory:,} bytes; the other weights are "
                        f"{rest:,})")
    cached = min(text.num_experts, experts_cache // moe_layers // per_expert)  # the load's split: even per layer
    disk = mode == "disk"
    page_cache = min(host_memory, experts_bytes) if disk else 0
    from_disk = 1 - page_cache / experts_bytes if disk else 0.0  # the share of moved bytes read from the disk
    move_s_per_byte = 1 / h2d_bandwidth + from_disk / disk_bandwidth
    gpu_read = decode_bytes(config, weights, units, cache, 1, 1, batch_size, experts_format)
    dense_params, expert_params = _active_matmul_params(config, experts_format)
    flops_per_token = 2 * (dense_params + moe_layers * top_k * expert_params)
    host_s_per_byte = 1 / host_bytes_per_s + from_disk / disk_bandwidth
    activation_bytes = 2 * 2 * text.latent_size  # a route's bf16 input to the host and its output back

    def missing(tokens: int) -> tuple[float, float]:
        """(experts one layer lacks, routes to them) in a forward of `tokens` tokens, expected."""
        return (expected_moved_experts(experts, top_k, tokens, cached),
                tokens * top_k * (1 - cached / experts))

    def layer_seconds(tokens: int) -> dict:
        """One MoE layer's missing experts: copied, or computed on the host; "auto" takes the faster."""
        lacking, routes = missing(tokens)
        copy = lacking * per_expert * move_s_per_byte
        # the disk tier streams too: the host step reads the mapped bytes where they are (our stacks, or the
        # release's w1, w3 and w2), at the page cache's rate or the disk's (host_s_per_byte)
        streamed = tokens <= STREAM_MAX_TOKENS
        host = max(lacking * per_expert * host_s_per_byte, routes * 2 * expert_params / host_flops) \
            + routes * activation_bytes / h2d_bandwidth \
            + (stream_layer_s if streamed else host_route_s if lacking else 0.0)
        # "auto" weighs what each side pays beside the experts, as the model's HostRates.streams does: copying in the
        # decode loop reads the routes (the piecewise loop's cost a layer), streaming pays the stream (in `host`)
        read = piecewise_layer_s if streamed else 0.0
        where = {"device": "device", "host": "host"}.get(experts_compute, "host" if host < copy + read else "device")
        return {"copy_s": copy, "host_s": host, "where": where, "s": copy if where == "device" else host,
                "host_streams": streamed, "streamed": streamed and where == "host",
                "moved_bytes": lacking * per_expert if where == "device" else 0.0,
                "host_bytes": lacking * per_expert if where == "host" else 0.0}

    decode_layer = layer_seconds(batch_size)
    piecewise_s = 0.0 if decode_layer["streamed"] else moe_layers * piecewise_layer_s
    decode_s = moe_layers * decode_layer["s"] + gpu_read / hbm_bandwidth + piecewise_s
    decode_moved = moe_layers * decode_layer["moved_bytes"]

    def prefill(size: int) -> dict:
        layer = layer_seconds(size * batch_size)
        transfer, compute = moe_layers * layer["s"], size * batch_size * flops_per_token / bf16_flops
        return {"chunk": size, "moved_bytes": moe_layers * layer["moved_bytes"], "where": layer["where"],
                "host_bytes": moe_layers * layer["host_bytes"], "transfer_s": transfer, "compute_s": compute,
                "bound_s": max(transfer, compute), "tokens_per_s": size * batch_size / max(transfer, compute)}

    room = after_weights - sum(cache) - experts_cache
    largest_fitting = max((2**p for p in range(31) if 2**p <= context and sum(device_transient(2**p)) <= room),
                          default=None)
    # one recommendation: the smallest power of two whose experts' time is under its compute, but never more than
    # fits beside the expert cache (past it the largest that fits, transfer-bound)
    sizes = [2**p for p in range(9, 31) if 2**p <= context]
    balanced = next((size for size in sizes if prefill(size)["transfer_s"] <= prefill(size)["compute_s"]), None)
    if largest_fitting is None:
        recommended, why = None, "none fits beside the expert cache"
    elif balanced is not None and balanced <= largest_fitting:
        recommended, why = balanced, "balanced"
    else:
        recommended, why = largest_fitting, "largest fitting"
    host_fits = disk or experts_bytes <= host_memory  # on disk the shards hold them; the page cache is a bonus
    return {"mode": mode, "gpu_memory": gpu_memory, "host_memory": host_memory, "context": context,
            "batch": batch_size, "prefill_chunk": chunk, "experts_format": experts_format,
            "h2d_bandwidth": h2d_bandwidth, "hbm_bandwidth": hbm_bandwidth, "bf16_flops": bf16_flops,
            "experts_compute": experts_compute, "host_bytes_per_s": host_bytes_per_s, "host_flops": host_flops,
            "measured": measured or {}, "piecewise_layer_s": piecewise_layer_s, "host_route_s": host_route_s,
            "stream_layer_s": stream_layer_s,
            "disk_bandwidth": disk_bandwidth if disk else None,
            "moe_layers": moe_layers, "num_experts": experts, "top_k": top_k, "bytes_per_expert": per_expert,
            "host": {"experts": experts_bytes, "left": host_memory - (page_cache if disk else experts_bytes),
                     "fits": host_fits, "page_cache": page_cache, "from_disk": from_disk},
            "gpu": {"weights": rest, "reserve": reserve, "cache": sum(cache), "workspace": workspace,
                    "compact_stack": compact,
                    "experts_cache": experts_cache, "left": left - experts_cache, "fits": left >= experts_cache},
            "cached_per_layer": cached, "hit_rate": cached / experts,
            "decode": {"moved_bytes": decode_moved, "gpu_bytes": gpu_read, "step_ms": decode_s * 1e3,
                       "gpu_ms": gpu_read / hbm_bandwidth * 1e3, "piecewise_ms": piecewise_s * 1e3,
                       "tokens_per_s": batch_size / decode_s, "where": decode_layer["where"],
                       "streamed": decode_layer["streamed"], "host_streams": decode_layer["host_streams"],
                       "host_bytes": moe_layers * decode_layer["host_bytes"],
                       "layer_copy_ms": decode_layer["copy_s"] * 1e3, "layer_host_ms": decode_layer["host_s"] * 1e3},
            "prefill": prefill(chunk),
            "recommended_chunk": recommended, "recommended_why": why,
            "recommended": prefill(recommended) if recommended is not None else None,
            "largest_fitting_chunk": largest_fitting,
            "fits": host_fits and left >= experts_cache,
            "flops_per_token": flops_per_token}


def measure_rates(config, experts_format: str | None = None, experts: int = 64, tokens: int = 32, repeats: int = 3,
                  threads: int | None = None, buffer_bytes: int = 2 * 2**30) -> dict:
    """Times this machine for `--measure`: the host's DRAM read (a reduction over a buffer of the experts' size, at
    least `buffer_bytes`, by default larger than a server's last-level cache), the CPU's routed experts at the model's
    widths in its experts format (the CPU kernel where it builds, else the reference:
    `host_experts_kimi_k3.host_routes`, what a load runs): one token's top-k experts through the host step, as a
    decode step runs them (`host_experts_kimi_k3.time_host_step`, windows of the `experts` experts; the reference over
    one token of each where there is no host step), and `tokens` tokens of one, and the pinned host-to-device copy
    where CUDA is available. Best of `repeats` after a warm-up. Returns bytes/s and flop/s."""
    import time

    import torch

    from kimik3.modeling.host_experts_kimi_k3 import host_routes, time_host_step

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    threads = threads or torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fmt = _format(_experts_format(experts_format))
        inter, latent = text.moe_intermediate_size, text.latent_size
        # every expert its own bytes, so a pass reads them from memory (the values do not change the time)
        stacks = (*fmt.empty((experts, 2 * inter, latent), torch.bfloat16),
                  *fmt.empty((experts, latent, inter), torch.bfloat16))
        per_expert = sum(t[0].numel() * t.element_size() for t in stacks)
        betas = (text.activation_situ_beta, text.activation_situ_linear_beta)

        def run(x, i, w, compact):
            return fmt.run(x, i, w, compact, betas)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        rows_one = torch.randn(experts, latent).bfloat16()
        # a decode step's pass, as a load times it (host_experts_kimi_k3.time_host_step: one token's top-k experts
        # through the host step); the reference over one token of each expert where the format has no host step
        chosen = min(text.num_experts_per_token, experts)
        step = time_host_step(stacks, fmt, chosen, latent, torch.bfloat16, betas, repeats)
        if step is None:
            step, chosen = best(lambda: host_routes(rows_one, torch.arange(experts), list(range(experts)), stacks, fmt,
                                                    run, betas)), experts
        host_bytes_per_s = chosen * per_expert / step
        rows_many = torch.randn(tokens, latent).bfloat16()
        many = best(lambda: host_routes(rows_many, torch.zeros(tokens, dtype=torch.int64), [0], stacks, fmt, run,
                                         betas))
        _, kernel = host_routes(rows_one[:1], torch.zeros(1, dtype=torch.int64), [0], stacks, fmt, run, betas)
        buffer = torch.ones(max(buffer_bytes, experts * per_expert) // 8, dtype=torch.int64)
        dram = buffer.numel() * 8 / best(lambda: buffer.sum())
        del buffer
        h2d = None
        if torch.cuda.is_available():
            pinned = torch.ones(2**30, dtype=torch.uint8).pin_memory()
            device = torch.empty_like(pinned, device="cuda")

            def copy():
                device.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()

            h2d = pinned.numel() / best(copy)
        if kernel:
            from kimik3.kernels import mxfp4_host

            name = f"kernel {mxfp4_host.isa()}"
        else:
            name = "reference (no CPU kernel for this format or it did not build)"
        return {"dram_read_bytes_per_s": dram, "host_bytes_per_s": host_bytes_per_s,
                "host_flops": tokens * 6 * inter * latent / many, "h2d_bandwidth": h2d, "host_kernel": name,
                "threads": threads, "experts": experts, "tokens": tokens, "bytes_per_expert": per_expert}
    finally:
        torch.set_num_threads(previous)


def _rates_line(plan: dict) -> str:
    measured = plan["measured"]
    host = (f"the CPU's experts: {plan['host_bytes_per_s'] / 1e9:,.1f} GB/s of packed bytes at one token (its top-k "
            "experts), "
            f"{plan['host_flops'] / 1e12:,.2f} TFLOP/s at many")
    target = measured.get("for_host_bandwidth")
    if target:
        host += (f" (for a host reading {target['dram_read_bytes_per_s'] / 1e9:,.0f} GB/s from DRAM, ASSUMED: the "
                 f"kernel at {target['kernel_fraction']:.0%} of it, "
                 + ("as measured here" if target["fraction_measured"] else "the fraction docs/benchmarks.md records")
                 + ")")
    elif measured.get("host_kernel"):
        dram = measured.get("dram_read_bytes_per_s")
        host += (f" (MEASURED: {measured['host_kernel']}, {measured['threads']} threads"
                 + (f"; DRAM read {dram / 1e9:,.1f} GB/s, the kernel at {plan['host_bytes_per_s'] / dram:.0%} of it"
                    if dram else "") + ")")
    elif plan["host_bytes_per_s"] == HOST_EXPERTS_BYTES_ASSUMED:
        host += " (ASSUMED: a server socket; --measure times this machine)"
    return host


def format_offload_plan(plan: dict, config, unit: str = "GB") -> str:
    scale = 10**9 if unit == "GB" else 2**30
    fmt = lambda n: f"{n / scale:,.2f} {unit}"  # noqa: E731
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    host, gpu, d, p = plan["host"], plan["gpu"], plan["decode"], plan["prefill"]
    experts = _format(plan["experts_format"]).summary
    assumed = " (ASSUMED: PCIe 5.0 x16, not measured)" if plan["h2d_bandwidth"] == H2D_BANDWIDTH_ASSUMED else ""
    e, k = plan["num_experts"], plan["top_k"]
    piecewise_assumed = (", ASSUMED: measured on an H100's host; --piecewise-layer-ms gives yours"
                         if plan["piecewise_layer_s"] == PIECEWISE_LAYER_S_ASSUMED else "")
    route_assumed = (", ASSUMED: measured on an H100's host; --host-route-ms gives yours"
                     if plan["host_route_s"] == HOST_ROUTE_S_ASSUMED else "")
    stream_assumed = (", ASSUMED: measured on an H100's host; --stream-layer-ms gives yours"
                      if plan["stream_layer_s"] == STREAM_LAYER_S_ASSUMED else "")
    disk = plan["mode"] == "disk"
    where = "on disk, mapped from the shards" if disk else "in host memory"
    if disk:
        disk_assumed = " (ASSUMED: one PCIe 4.0 NVMe SSD, sequential read, not measured)" \
            if plan["disk_bandwidth"] == DISK_BANDWIDTH_ASSUMED else ""
        host_line = (f"disk: routed experts {fmt(host['experts'])} stay in the shards; the page cache keeps "
                     f"{fmt(host['page_cache'])} of them ({1 - host['from_disk']:.1%}) in {fmt(plan['host_memory'])} of "
                     f"host memory; the rest is read at {plan['disk_bandwidth'] / 1e9:.1f} GB/s{disk_assumed}")
        moved = lambda n: (f"{fmt(n)} moved x (1 / {plan['h2d_bandwidth'] / 1e9:.1f} GB/s host->device{assumed} "  # noqa: E731
                           f"+ {host['from_disk']:.1%} / {plan['disk_bandwidth'] / 1e9:.1f} GB/s disk)")
    else:
        host_line = (f"host memory: routed experts {fmt(host['experts'])} of {fmt(plan['host_memory'])}: "
                     + (f"FITS, {fmt(host['left'])} left" if host["fits"] else
                        f"DOES NOT FIT ({fmt(-host['left'])} over)"))
        moved = lambda n: f"{fmt(n)} moved / {plan['h2d_bandwidth'] / 1e9:.1f} GB/s host->device{assumed}"  # noqa: E731
    lines = [
        f"Kimi K3 text model, {describe_layers(text)}, {e} routed experts per MoE layer as {experts}, top-{k}",
        f"routed experts {where} (experts_offload={plan['mode']!r}), the rest on one GPU of "
        f"{fmt(plan['gpu_memory'])}; context {plan['context']:,} tokens x batch {plan['batch']}; units: GB = 10^9 "
        "bytes, GiB = 2^30 bytes",
        host_line,
        f"GPU: other weights {fmt(gpu['weights'])}, reserved {fmt(gpu['reserve'])} (CUDA context "
        f"{fmt(CUDA_CONTEXT_RESERVE)} + allocator {ALLOCATOR_RESERVE_FRACTION:.0%} of the GPU, ASSUMED), cache "
        f"{fmt(gpu['cache'])}, workspace {fmt(gpu['workspace'])} + compact expert stack {fmt(gpu['compact_stack'])} "
        f"(prefill chunk {plan['prefill_chunk']:,}), expert cache {fmt(gpu['experts_cache'])}: "
        + (f"FITS, {fmt(gpu['left'])} left" if gpu["fits"] else f"DOES NOT FIT ({fmt(-gpu['left'])} over)"),
        f"expert cache: {plan['cached_per_layer']} of {e} experts per MoE layer ({plan['moe_layers']} layers x "
        f"{plan['bytes_per_expert']:,} bytes an expert); expected hit rate under uniform routing "
        f"{plan['hit_rate']:.2%} (random weights route near uniformly: the worst case for a cache)",
        _rates_line(plan),
        "",
        f"expected experts missing per layer and forward of T tokens = {e} x (1 - (1 - {k}/{e})^T) (distinct chosen) "
        f"x (1 - {plan['cached_per_layer']}/{e}) (not cached); experts_compute={plan['experts_compute']!r}: "
        + {"device": "copied to the GPU", "host": "computed on the CPU",
           "auto": "copied or computed on the CPU, whichever is faster for that forward"}[plan["experts_compute"]],
        f"decode step at batch {plan['batch']}: a layer's missing experts copied {d['layer_copy_ms']:,.2f} ms or "
        f"computed on the CPU {d['layer_host_ms']:,.2f} ms ("
        + (f"in the stream's order, no route read: the stream's own {plan['stream_layer_s'] * 1e3:,.3f} ms "
           f"included{stream_assumed}" if d["host_streams"] else
           f"the route's own {plan['host_route_s'] * 1e3:,.2f} ms included{route_assumed}")
        + f") -> {d['where']}; "
        + (f"{moved(d['moved_bytes'])}" if d["where"] == "device" else
           f"{fmt(d['host_bytes'])} read by the CPU")
        + f" + {fmt(d['gpu_bytes'])} read / {plan['hbm_bandwidth'] / 1e12:.2f} TB/s HBM ({d['gpu_ms']:,.1f} ms)"
        + ("; the loop captures the step whole" if d["streamed"] else
           f" + the piecewise-captured loop's reads of the routes ({plan['moe_layers']} MoE layers x "
           f"{plan['piecewise_layer_s'] * 1e3:,.2f} ms = {d['piecewise_ms']:,.1f} ms{piecewise_assumed})")
        + f" = {d['step_ms']:,.1f} ms ({d['tokens_per_s']:,.2f} tokens/s; no overlap counted)",
        f"prefill chunk of {p['chunk']:,} tokens: experts {p['transfer_s']:,.2f} s ({p['where']}: "
        + (f"{fmt(p['moved_bytes'])} moved" if p["where"] == "device" else f"{fmt(p['host_bytes'])} read by the CPU")
        + f"), compute {p['compute_s']:,.2f} s at {plan['bf16_flops'] / 1e12:,.0f} TFLOP/s bf16 peak -> "
        f"{p['tokens_per_s']:,.0f} tokens/s at best",
    ]
    r, fitting = plan["recommended"], plan["largest_fitting_chunk"]
    fits_text = f"{fitting:,} tokens" if fitting is not None else "none, not even 1 token"
    if r is None:
        lines.append(f"recommended prefill chunk: none (the largest whose workspace fits beside the expert cache: "
                     f"{fits_text})")
    elif plan["recommended_why"] == "balanced":
        lines.append(f"recommended prefill chunk: {r['chunk']:,} tokens, the smallest power of two whose experts' "
                     f"time ({r['transfer_s']:,.2f} s) is under its compute ({r['compute_s']:,.2f} s): "
                     f"{r['tokens_per_s']:,.0f} tokens/s at best (the largest that fits: {fits_text})")
    else:
        lines.append(f"recommended prefill chunk: {r['chunk']:,} tokens, the largest whose workspace fits beside the "
                     f"expert cache; its experts' time ({r['transfer_s']:,.2f} s) is over its compute "
                     f"({r['compute_s']:,.2f} s): {r['tokens_per_s']:,.0f} tokens/s at best")
    lines.append("verdict: " + ("FITS" if plan["fits"] else "DOES NOT FIT") + (" (the GPU; the experts on disk)"
                                                                               if disk else " (host memory and GPU)"))
    return "\n".join(lines)
