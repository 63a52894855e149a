"""`kimik3 demo`: a tiny release-layout checkpoint (MXFP4 experts) -> `kimik3 convert` -> reload with
trust_remote_code -> greedy generate -> the cache's live bytes against the analytic count.

Everything lives in a temporary folder removed at the end, so the report names no paths; transformers' progress bars
are off while it runs, so a normal run prints only its own four steps."""

import contextlib
import tempfile
from pathlib import Path

CACHE_PARTS = ("mla_kv", "kda_state", "kda_conv", "total")


def run_demo(new_tokens: int = 12, say=print) -> bool:
    """Runs the demo, reporting each step through `say`. True when the live cache bytes match the analytic ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from kimik3.convert.converter import convert
    from kimik3.convert.testing import write_release_checkpoint
    from kimik3.modeling.cache_kimi_k3 import analytic_cache_bytes
    from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

    with tempfile.TemporaryDirectory() as tmp, progress_bars_off():
        model_dir = Path(tmp) / "model"
        release = write_release_checkpoint(Path(tmp) / "release", seed=0, vision=False)
        convert(release.path, model_dir, text_only=True, progress=False)
        say("1. wrote a tiny release-layout checkpoint (MXFP4 experts) to a temporary folder -> kimik3 convert")
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
        say(f"2. reloaded with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True): "
            f"{type(model).__name__} from the folder's {type(model).__module__.rsplit('.', 1)[-1]}.py")
        prompt = torch.tensor([[5, 17, 42, 9, 33, 8, 21, 64]])
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        say(f"3. greedy generate: prompt {prompt[0].tolist()} -> {out.sequences[0, prompt.shape[1]:].tolist()}")
        cache = getattr(out, CACHE_FIELD)
        live = cache.live_bytes()
        analytic = analytic_cache_bytes(model.config, cache.get_seq_length(), 1,
                                        dtype_bytes=next(model.parameters()).element_size())
        say(f"4. cache after {cache.get_seq_length()} tokens (live vs analytic, bytes):")
        for part in CACHE_PARTS:
            verdict = "ok" if live[part] == analytic[part] else "MISMATCH"
            say(f"   {part:10s} {live[part]:>10,} {analytic[part]:>10,}  {verdict}")
    return live == analytic


@contextlib.contextmanager
def progress_bars_off():
    """transformers' loading / saving progress bars off for the demo, restored after."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
