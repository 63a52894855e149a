"""The cache-memory table of `kimik3 memory`: K3's hybrid cache vs the same depth all-MLA vs expanded K/V.
(Activation memory during training is `kimik3.training.memory`.)"""

import json
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
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a folder; give the path of its config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, not a {type(data).__name__}")
    try:
        return _text_config_of(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


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


def describe_layers(config) -> str:
    num_layers = len(config.layer_types)
    num_mla = sum(t == "full_attention" for t in config.layer_types)
    return f"{num_layers} layers ({num_layers - num_mla} KDA, {num_mla} MLA)"


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
