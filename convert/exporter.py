"""`kimik3 export SRC DST`: our layout (converted or fine-tuned) -> the release layout.

Names and shard layout as the release (shard k holds decoder layer k-1, then embed/head/norms, projector, vision;
`model-XXXXX-of-0000NN.safetensors`, 6-digit total), config.json from `to_release_dict()` (1-based lists, the
release's MXFP4 quantization_config), `A_log` zero-padded to the length the source had (recorded by convert in
kimik3_conversion.json; without a record max(128, H), as the release pads its 96 heads to 128), experts split per
expert and re-quantised to MXFP4 (`quantize_mxfp4`, OCP scale rule, round to nearest even), with the round-trip
error measured on every expert. Experts kept packed are split without re-quantisation. Everything else is copied bit for bit (or cast to the release dtype, with a note).

The exported folder carries no model code. Its config.json is the release's, whose `auto_map` names the release's
own `configuration_kimi_k3.py` / `modeling_kimi_k3.py` / `modeling_kimi_linear.py`; our files under those names
would load into the wrong layout, so none are written, and README.md, the report and the CLI say how to load the
folder instead (`HOW_TO_LOAD`). The release's tokenizer and processor files are carried verbatim when present.
"""

import json
import math
from pathlib import Path

from . import files
from .checkpoint import RELEASE_TOTAL_DIGITS, Checkpoint, check_inside, shard_file_name
from .converter import CONVERTER_VERSION
from .engine import ShardPlan, check_paths, check_threads, write_checkpoint
from .errors import ConversionError
from .plan import RunContext, build_export_plan
from .schedule import release_config_dict

EXPORT_REPORT_NAME = "kimik3_export.json"
HOW_TO_LOAD = (
    "this folder is in the Kimi K3 release layout and carries no model code: config.json's auto_map names the "
    "release's configuration_kimi_k3.py, modeling_kimi_k3.py and modeling_kimi_linear.py, which are not here. Load "
    "it with the release's official code (copy those three files from the release, moonshotai/Kimi-K3, into the "
    "folder), or convert it back with `kimik3 convert THIS_FOLDER OUT` and load OUT with trust_remote_code=True"
)
REQUANTISED_NOTE = (
    "experts were re-quantised with the OCP scale rule: `experts_bit_exact` counts experts whose values came back "
    "exactly; where the source chose another valid scale the bytes differ though the values are equal "
    "(`kimik3 verify SOURCE_RELEASE EXPORTED` reports bytes-equal and values-equal tensors separately)"
)


def export_readme(source) -> bytes:
    return (f"# Kimi K3, release layout (exported by `kimik3 export` from `{source}`)\n\n"
            f"How to load: {HOW_TO_LOAD}.\n").encode()


def release_shards(tensors, num_layers: int) -> list[ShardPlan]:
    groups = [f"layer:{i}" for i in range(num_layers)] + ["model", "projector", "vision"]
    by_group = {g: [t for t in tensors if t.group == g] for g in groups}
    kept = [g for g in groups if by_group[g] or g.startswith("layer:") or g == "model"]
    total = len(kept)
    return [ShardPlan(shard_file_name(k, total, RELEASE_TOTAL_DIGITS), by_group[g])
            for k, g in enumerate(kept, start=1)]


def summarise_error(stats: dict) -> dict:
    """Round-trip error of the re-quantised experts over all shards: relative RMS error, max |error|, and how many
    experts came back bit-exact (all of them, when the experts were never changed after conversion)."""
    totals = {"experts": 0, "exact_experts": 0, "weights": 0, "sum_sq_err": 0.0, "sum_sq_ref": 0.0, "max_abs_err": 0.0}
    for bucket in stats.values():
        for key in totals:
            if key == "max_abs_err":
                totals[key] = max(totals[key], bucket.get(key, 0.0))
            else:
                totals[key] += bucket.get(key, 0)
    rel = math.sqrt(totals["sum_sq_err"] / totals["sum_sq_ref"]) if totals["sum_sq_ref"] else 0.0
    return {
        "experts_requantised": totals["experts"],
        "experts_bit_exact": totals["exact_experts"],
        "relative_rms_error": rel,
        "max_abs_error": totals["max_abs_err"],
        "weights": totals["weights"],
    }


def export(src, dst, *, overwrite: bool = False, progress: bool = True, allow_unknown: bool = False,
           threads: int | None = None) -> dict:
    check_threads(threads)
    check_paths(src, dst)
    dst = Path(dst)
    context = RunContext()
    with Checkpoint(src) as ckpt:
        if dst.resolve() == ckpt.root.resolve() or ckpt.root.resolve() in dst.resolve().parents:
            raise ConversionError(f"{dst}: the destination is " + ("the source folder" if dst.resolve() ==
                                  ckpt.root.resolve() else f"inside the source folder {ckpt.root}"))
        plan = build_export_plan(ckpt, context, allow_unknown=allow_unknown)
        shards = release_shards(plan.tensors, ckpt.text_config.num_hidden_layers)
        release_config = release_config_dict(ckpt.config)
        identity = {"source_index_sha256": ckpt.index_digest(), "config": release_config,
                    "version": CONVERTER_VERSION}

        notes = sorted(set(plan.notes + ([REQUANTISED_NOTE] if plan.requantised else [])))
        notes.append(f"how to load: {HOW_TO_LOAD}")

        def side_files():
            # the release's tokenizer / processor files only: no model code (see the module docstring)
            out = files.release_tokenizer_files(ckpt.root)
            generation = ckpt.root / "generation_config.json"
            release_generation = files.read_provenance(ckpt.root).get("release_generation_config")
            if release_generation is not None:  # what the conversion changed goes back as the release had it
                out.append(("generation_config.json", release_generation.encode("utf-8")))
            elif generation.exists():
                check_inside(ckpt.root, generation)
                out.append(("generation_config.json", generation.read_bytes()))
            report = {"source": str(src), "notes": notes, "how_to_load": HOW_TO_LOAD,
                      "experts_roundtrip": summarise_error(context.stats)}
            out.append((EXPORT_REPORT_NAME, files.json_bytes(report)))
            out.append(("README.md", export_readme(src)))
            return out

        def final_files():
            # the release's own formatting: sorted keys, indent 2, no trailing newline
            return [("config.json", json.dumps(release_config, indent=2, sort_keys=True).encode())]

        summary = write_checkpoint(dst, shards, identity, side_files, final_files, context, overwrite=overwrite,
                                   progress=progress, label="kimik3 export", threads=threads,
                                   sources={s: ckpt.shard_path(s) for s in sorted(set(ckpt.weight_map.values()))})
    summary["experts_roundtrip"] = summarise_error(context.stats)
    summary["notes"] = notes
    summary["how_to_load"] = HOW_TO_LOAD
    return summary
