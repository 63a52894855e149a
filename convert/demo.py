"""`kimik3 demo` helper: a tiny release-layout checkpoint (MXFP4 experts) converted into a model folder."""

from pathlib import Path

from .converter import convert
from .testing import write_release_checkpoint


def release_layout_to_model_dir(workdir, model_dir, seed: int = 0) -> dict:
    release = write_release_checkpoint(Path(workdir) / "release", seed=seed, vision=False)
    return convert(release.path, model_dir, text_only=True, progress=False)
