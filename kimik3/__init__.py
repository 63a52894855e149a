"""Kimi K3 for Hugging Face transformers."""

__version__ = "0.1.0"
