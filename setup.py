"""Kimi K3 for Hugging Face transformers: remote code, converter, kernels and training tools.

Import names are namespaced under `kimik3` (transformers imports a PyPI package called `kernels`, so nothing here
installs a top-level `kernels`, `convert` or `configuration`): the design-card folders map to subpackages.
"""

from setuptools import setup

PACKAGE_DIRS = {
    "kimik3": "kimik3",
    "kimik3.training": "kimik3/training",
    "kimik3.modeling": "modeling_kimik3",
    "kimik3.configuration": "configuration",
    "kimik3.convert": "convert",
    "kimik3.kernels": "kernels",
    "kimik3.hub_card": "hub_card",
}

setup(
    name="kimik3",
    version="0.1.0",
    description="Kimi K3 for Hugging Face transformers: exact PyTorch modeling, hybrid cache, converter, training",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    # the host experts kernel's C source is compiled at first use (kernels/mxfp4_host.py)
    package_data={"kimik3.configuration": ["*.json", "*.jinja"], "kimik3.hub_card": ["*.md"],
                  "kimik3.kernels": ["csrc/*.c"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17,<6",
        "accelerate",
        "safetensors",
        "tokenizers",
        "huggingface_hub",
        # the image processor (kimik3 tiny writes its config; the chat and the processor use it): transformers'
        # image-processor classes are placeholders without Pillow
        "pillow",
    ],
    # serve: the web stack `transformers serve` uses; the tests talk to the server with the official openai client
    extras_require={"test": ["pytest", "pytest-xdist", "peft>=0.19.1", "trl>=1.16", "lm_eval>=0.4.13", "pillow",
                             "fastapi", "uvicorn", "openai", "httpx"],
                    "train": ["peft>=0.19.1", "trl>=1.16", "lm_eval>=0.4.13"], "gpu": ["fla-core>=0.5.2"],
                    "vision": ["pillow"], "serve": ["fastapi", "uvicorn"]},
    entry_points={"console_scripts": ["kimik3=kimik3.cli:main"]},
)
