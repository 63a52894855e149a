"""`kimik3 convert SRC DST`: release layout -> our transformers layout."""

from pathlib import Path

from transformers.utils.hub import convert_file_size_to_int
from kimik3.hub_card import converted_model_card
from kimik3.modeling.configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT
from kimik3.modeling.files_kimi_k3 import looks_like_local_path
from kimik3.remote_code import remote_code_entries

from . import files
from .checkpoint import Checkpoint
from .engine import check_paths, check_threads, plan_shards_by_size, write_checkpoint
from .errors import ConversionError
from .plan import streamed_format
from .plan import ConvertOptions, RunContext, build_convert_plan
from .schedule import output_config_dict

CONVERTER_VERSION = "1"


def parse_size(value) -> int:
    """--max-shard-size: transformers' spelling ("5GB", "500MB", "2GiB"; what save_pretrained's max_shard_size takes),
    or a whole number of bytes."""
    try:
        size = int(value) if isinstance(value, str) and value.strip().isdigit() else convert_file_size_to_int(value)
    except (ValueError, AttributeError):
        size = None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConversionError(f"cannot read size {value!r} as a positive size (use e.g. 5GB, 500MB, 2GiB)")
    return size


def _hub_checkpoint(repo_id: str, revision: str | None, chunk_bytes: int) -> Checkpoint:
    """A Hub repo: everything but the weights first, then each shard on first use (so only needed shards come)."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub is a transformers dependency
        raise ConversionError(f"{repo_id}: not a local folder and huggingface_hub is not installed") from None
    try:
        root = Path(snapshot_download(repo_id, revision=revision, ignore_patterns=["*.safetensors"]))
    except Exception as exc:  # network / auth / missing repo: report, do not guess
        raise ConversionError(f"{repo_id}: not a local folder, and the Hub download failed: {exc}") from None
    commit = root.name

    def fetch(shard: str) -> None:
        hf_hub_download(repo_id, shard, revision=commit)

    return Checkpoint(root, chunk_bytes, fetch=fetch)


def open_source(src, revision: str | None, chunk_bytes: int) -> Checkpoint:
    """A local folder, or a Hub repo id (`org/name`). What can only be a local path (files_kimi_k3.
    looks_like_local_path: `./k3`, `/data/k3`, `a/b/c`, `models/k3` next to a `models/` folder) is never looked up on
    the Hub: a missing one is reported as missing."""
    path = Path(src)
    if path.exists():
        return Checkpoint(path, chunk_bytes)
    if not looks_like_local_path(str(src)) and "/" in str(src):
        return _hub_checkpoint(str(src), revision, chunk_bytes)
    raise ConversionError(f"{src}: no such folder (a local path, so not looked up on the Hub, which takes repo ids "
                          "`org/name`)")


def processor_config(ckpt: Checkpoint, plan, notes: list) -> bytes | None:
    """Our processor_config.json when the vision tower is converted and the release has its image settings
    (preprocessor_config.json), so AutoProcessor gives our processor; None otherwise (--text-only writes none).
    Release image settings our processor does not apply are added to `notes`."""
    if not any(t.group in ("projector", "vision") for t in plan.tensors):
        return None
    if not (ckpt.root / files.PREPROCESSOR_CONFIG_NAME).is_file():
        notes.append(f"the source has no {files.PREPROCESSOR_CONFIG_NAME}: no {files.PROCESSOR_CONFIG_NAME} is "
                     "written; build the processor with KimiK3Processor(tokenizer=...) (release image settings)")
        return None
    settings, unapplied = files.media_proc_settings(ckpt.root, ckpt.vision_config)
    notes.extend(unapplied)
    return files.processor_config_bytes(settings)


def convert(
    src,
    dst,
    *,
    text_only: bool = False,
    experts_format: str = DEFAULT_EXPERTS_FORMAT,
    num_layers: int | None = None,
    num_experts: int | None = None,
    allow_unknown: bool = False,
    max_shard_size="5GB",
    overwrite: bool = False,
    progress: bool = True,
    revision: str | None = None,
    chunk_bytes: int | None = None,
    threads: int | None = None,
) -> dict:
    """Converts a release-layout checkpoint (folder or Hub id) into our layout in `dst`. Returns a summary dict."""
    streamed_format(experts_format)
    check_threads(threads)
    check_paths(src, dst)
    options = ConvertOptions(
        text_only=text_only,
        experts_format=experts_format,
        num_layers=num_layers,
        num_experts=num_experts,
        allow_unknown=allow_unknown,
        max_shard_bytes=parse_size(max_shard_size),
    )
    if chunk_bytes:
        options.chunk_bytes = chunk_bytes
    dst = Path(dst)
    with open_source(src, revision, options.chunk_bytes) as ckpt:
        if dst.resolve() == ckpt.root.resolve() or ckpt.root.resolve() in dst.resolve().parents:
            # the source folder is only read: outputs inside it would be mixed into the checkpoint
            raise ConversionError(f"{dst}: the destination is " + ("the source folder" if dst.resolve() ==
                                  ckpt.root.resolve() else f"inside the source folder {ckpt.root}"))
        plan = build_convert_plan(ckpt, options)
        config = output_config_dict(ckpt.config, plan.text_config, text_only)
        shards = plan_shards_by_size(plan.tensors, options.max_shard_bytes)
        source_text = ckpt.text_config
        provenance = {
            "converter_version": CONVERTER_VERSION,
            "source": str(src),
            "revision": revision,
            "source_index_sha256": ckpt.index_digest(),
            "options": {
                "text_only": text_only,
                "experts_format": experts_format,
                "num_layers": num_layers,
                "num_experts": num_experts,
                "allow_unknown": allow_unknown,
            },
            "layer_map": plan.layer_map,
            "num_layers": len(plan.layer_map),
            "source_num_layers": source_text.num_hidden_layers,
            "num_experts": plan.num_experts,
            "source_num_experts": source_text.num_experts,
            "experts_format": plan.text_config.experts_format,
            "num_kda": plan.text_config.layer_types.count("linear_attention"),
            "num_mla": plan.text_config.layer_types.count("full_attention"),
            "top_k": plan.text_config.num_experts_per_token,
            # the source's zero-padded A_log length (the release pads 96 heads to 128); export restores it
            "release_a_log_length": plan.release_a_log_length(),
            "notes": plan.notes,
            "skipped_unknown": plan.skipped_unknown,
            "tensors": len(plan.tensors),
            "shards": len(shards),
            "bytes": sum(s.nbytes for s in shards),
        }
        tokenizer_out, provenance["tokenizer_changes"] = files.converted_tokenizer_files(
            ckpt.root, processor_config(ckpt, plan, provenance["notes"]))
        generation_out, release_generation = files.generation_config_bytes(ckpt.root, ckpt.config)
        if release_generation is not None:
            provenance["release_generation_config"] = release_generation
        used_shards = ckpt.shards_used(plan.source_names)
        # the source as a resolved path, so `k3`, `k3/` and `/abs/k3` are one run; its shards' contents are
        # fingerprinted by the engine (`sources`)
        identity = {
            "provenance": dict(provenance, source=str(ckpt.root.resolve())),
            "config": config,
            "max_shard_bytes": options.max_shard_bytes,
        }
        def side_files():
            out = list(tokenizer_out)
            out += [(name, path.read_bytes()) for name, path in remote_code_entries()]
            out.append(("generation_config.json", generation_out))
            out.append((files.PROVENANCE_NAME, files.json_bytes(provenance)))
            out.append(("README.md", converted_model_card(provenance, config).encode()))
            return out

        def final_files():
            return [("config.json", files.json_bytes(config))]

        summary = write_checkpoint(
            dst,
            shards,
            identity,
            side_files,
            final_files,
            RunContext(),
            overwrite=overwrite,
            progress=progress,
            label="kimik3 convert",
            threads=threads,
            sources={shard: ckpt.shard_path(shard) for shard in used_shards},
        )
    summary.update(provenance=provenance, source_shards_read=used_shards)
    return summary


__all__ = ["convert", "parse_size", "open_source", "CONVERTER_VERSION"]
