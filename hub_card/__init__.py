"""Model-card template for converted or fine-tuned Kimi K3 folders."""

from pathlib import Path

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card_template.md"


def render_model_card(**fields) -> str:
    """Fill the template; every `{name}` in it must be given (a missing one raises KeyError naming it)."""
    return TEMPLATE_PATH.read_text().format(**fields)
