"""The `kimik3` command: tiny models, the cache-memory table, the demo, and the converter entry points."""

import argparse
import fnmatch
import json
import shutil
import sys
import tempfile
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a usage error, exit code 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _modeling_dir() -> Path:
    import kimik3.modeling

    return Path(kimik3.modeling.__file__).resolve().parent


def remote_code_files() -> list[Path]:
    """The files a model folder needs to run as remote code (flat, relative imports only between them)."""
    return sorted(p for p in _modeling_dir().glob("*.py") if p.name != "__init__.py")


def build_tiny_model(seed: int = 0, num_hidden_layers: int = 4, **overrides):
    """A small random K3 model with every mechanism on; pseudo-queries get random values (zeros would hide
    AttnRes bugs: uniform mixing)."""
    import torch

    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    torch.manual_seed(seed)
    config = KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=num_hidden_layers, **overrides))
    model = KimiK3ForCausalLM(config)
    with torch.no_grad():
        # every pseudo-query, layer 0's unused one (a buffer) included, in module order
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("res_proj.weight"):
                tensor.normal_(0.0, 0.5)
    return model.eval()


def save_with_code(model, directory: str | Path) -> Path:
    """save_pretrained + the remote-code files + auto_map, loadable with trust_remote_code in a fresh process."""
    directory = Path(directory)
    model.config.register_for_auto_class()
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(directory)
    # save_pretrained copies the modeling file and what it imports relatively; copy all of them in any case, and
    # map AutoModel too (the release's auto_map has both).
    for path in remote_code_files():
        shutil.copy2(path, directory / path.name)
    config = json.loads((directory / "config.json").read_text())
    model_class = f"modeling_kimi_k3.{type(model).__name__}"
    config["auto_map"] = {
        "AutoConfig": f"configuration_kimi_k3.{type(model.config).__name__}",
        "AutoModel": model_class,
        "AutoModelForCausalLM": model_class,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


# ------------------------------------------------------------------------------------------------------------
# Memory table


def memory_table(config, context_lengths=(131072, 1048576), batch_size: int = 1, dtype_bytes: int = 2) -> list[dict]:
    """Cache bytes: K3 (latent MLA + KDA state + conv) vs the same depth all-MLA (latent) vs the official remote
    code (expanded K/V per MLA layer)."""
    from kimik3.modeling.cache_kimi_k3 import analytic_cache_bytes

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = len(text.layer_types)
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    expanded_per_token = text.num_attention_heads * (text.qk_head_dim + text.v_head_dim)
    rows = []
    for tokens in context_lengths:
        k3 = analytic_cache_bytes(text, tokens, batch_size, dtype_bytes)
        rows.append(
            {
                "tokens": tokens,
                "batch": batch_size,
                "k3_mla_kv": k3["mla_kv"],
                "k3_kda_state": k3["kda_state"],
                "k3_kda_conv": k3["kda_conv"],
                "k3_total": k3["total"],
                "all_mla_latent": num_layers * tokens * text.mla_cache_dim * dtype_bytes * batch_size,
                "official_expanded_kv": num_mla * tokens * expanded_per_token * dtype_bytes * batch_size,
            }
        )
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:9.3f} GiB"


def format_memory_table(rows: list[dict]) -> str:
    header = (f"{'tokens':>9} {'batch':>5} | {'K3 MLA KV':>13} {'K3 KDA state':>13} {'K3 conv':>13} "
              f"{'K3 total':>13} | {'all-MLA':>13} | {'expanded K/V':>13}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['tokens']:>9} {r['batch']:>5} | {_gib(r['k3_mla_kv'])} {_gib(r['k3_kda_state'])} "
            f"{_gib(r['k3_kda_conv'])} {_gib(r['k3_total'])} | {_gib(r['all_mla_latent'])} | "
            f"{_gib(r['official_expanded_kv'])}"
        )
    return "\n".join(lines)


def _load_text_config(path: str | None):
    from kimik3.configuration import released_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

    data = released_config_dict() if path is None else json.loads(Path(path).read_text())
    if "text_config" in data:
        return KimiK3Config(**data).text_config
    return KimiK3TextConfig(**data)


# ------------------------------------------------------------------------------------------------------------
# Commands


# What `kimik3 tiny` writes (save_pretrained, then the remote code); with --overwrite these are replaced.
TINY_FILES = ("config.json", "generation_config.json", "model.safetensors")


class TinyFolderError(ValueError):
    pass


def check_tiny_directory(directory: Path, overwrite: bool) -> list[str]:
    """Refuses a folder that is not empty unless --overwrite; even then refuses one holding model files that tiny
    does not write (they would be mixed into the new model). Returns the names of the other files, which stay."""
    if directory.exists() and not directory.is_dir():
        raise TinyFolderError(f"{directory}: exists and is not a folder")
    if not directory.exists() or not any(directory.iterdir()):
        return []
    if not overwrite:
        raise TinyFolderError(f"{directory}: the folder is not empty; pass --overwrite to replace the model files "
                              "there (other files are kept)")
    from kimik3.convert.engine import MODEL_FILE_PATTERNS

    ours = set(TINY_FILES) | {p.name for p in remote_code_files()}
    others = sorted(p.name for p in directory.iterdir() if p.name not in ours)
    mixed = [name for name in others if any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)]
    if mixed:
        raise TinyFolderError(f"{directory}: holds model files that `kimik3 tiny` does not write ({', '.join(mixed)}); "
                              "they would be mixed into the new model: delete or move them, or choose another folder")
    return others


def cmd_tiny(args) -> int:
    directory = Path(args.directory)
    try:
        kept = check_tiny_directory(directory, args.overwrite)
    except TinyFolderError as exc:
        print(f"kimik3 tiny: error: {exc}", file=sys.stderr)
        return 2
    model = build_tiny_model(seed=args.seed, num_hidden_layers=args.layers)
    save_with_code(model, directory)
    for name in kept:
        print(f"note: kept {name} in {directory} (not a file kimik3 tiny writes)")
    print(f"wrote a tiny random Kimi K3 ({sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{args.layers} layers) to {args.directory}")
    return 0


def cmd_memory(args) -> int:
    config = _load_text_config(args.config)
    lengths = [int(x) for x in args.tokens.split(",")]
    rows = memory_table(config, lengths, args.batch)
    num_mla = sum(t == "full_attention" for t in config.layer_types)
    print(f"Cache memory, {len(config.layer_types)} layers ({len(config.layer_types) - num_mla} KDA, {num_mla} MLA), "
          f"bf16 activations, f32 KDA state")
    print(format_memory_table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


def cmd_demo(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from kimik3.modeling.cache_kimi_k3 import analytic_cache_bytes

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        source = "tiny random model"
        try:
            from kimik3.convert.demo import release_layout_to_model_dir
        except ImportError:
            release_layout_to_model_dir = None
        if release_layout_to_model_dir is not None:
            release_layout_to_model_dir(Path(tmp), model_dir)
            source = "tiny release-layout checkpoint (MXFP4 experts) -> kimik3 convert"
        else:
            save_with_code(build_tiny_model(), model_dir)
        print(f"1. wrote {source}: {model_dir}")
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
        print(f"2. reloaded with AutoModelForCausalLM(trust_remote_code=True): {type(model).__name__} from "
              f"{type(model).__module__}")
        prompt = torch.tensor([[5, 17, 42, 9, 33, 8, 21, 64]])
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True)
        tokens = out.sequences[0, prompt.shape[1]:].tolist()
        print(f"3. greedy generate: prompt {prompt[0].tolist()} -> {tokens}")
        cache = getattr(out, "cache", None) or out.past_key_values
        live = cache.live_bytes()
        analytic = analytic_cache_bytes(model.config, cache.get_seq_length(), 1,
                                        dtype_bytes=next(model.parameters()).element_size())
        print(f"4. cache after {cache.get_seq_length()} tokens (live vs analytic, bytes):")
        for kind in ("mla_kv", "kda_state", "kda_conv", "total"):
            print(f"   {kind:10s} {live[kind]:>10,} {analytic[kind]:>10,}  {'ok' if live[kind] == analytic[kind] else 'MISMATCH'}")
        if live != analytic:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 for Hugging Face transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny", help="write a small random K3 model folder loadable with trust_remote_code")
    p.add_argument("directory")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--overwrite", action="store_true", help="replace the model files of a non-empty folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_tiny)

    p = sub.add_parser("memory", help="cache memory table: K3 vs all-MLA vs expanded K/V")
    p.add_argument("--config", help="config.json (released top-level or text config); default: the release")
    p.add_argument("--tokens", default="131072,1048576")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_memory)

    p = sub.add_parser("demo", help="tiny model -> save with code -> reload (trust_remote_code) -> generate")
    p.add_argument("--new-tokens", type=int, default=12)
    p.set_defaults(fn=cmd_demo)

    for name in ("convert", "export", "verify"):
        p = sub.add_parser(name, help=f"{name} checkpoints (see `kimik3 {name} --help`)", add_help=False)
        p.set_defaults(fn=None, passthrough=name)

    try:  # argparse exits (code 2, `kimik3 <cmd>: error: ...`) on a usage error; callers want the code
        args, rest = parser.parse_known_args(argv)
        if getattr(args, "passthrough", None):
            from kimik3.convert import cli as convert_cli

            return getattr(convert_cli, f"run_{args.passthrough}")(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:
        return int(exc.code or 0)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
