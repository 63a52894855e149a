# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The decode loop of `generate(..., cache_implementation="static")` (docs/design.md, Decode loop): many decode
steps per host round trip.

One step is the model's forward on the static cache, the logits processing (greedy; temperature, top-k, top-p,
min-p sampling; the minimum-length gates) and the stop flags (eos ids, finished rows padded), all device-side with
static shapes. On CUDA the step is compiled and `block_steps` of them are captured as one CUDA graph, so the host
launches a block with one replay and reads its tokens (and whether any row is still running) with one copy: the
host looks at the stop condition every `block_steps` steps, and a streamer gets every step's tokens, in the order
and shapes transformers' loop gives them, once per block. Elsewhere the same step function runs eagerly (or
compiled, `decode_compile=True`), `block_steps` calls per host read.

A model folder carries this file as `custom_generate/generate.py`: `from_pretrained(..., trust_remote_code=True)`
installs its `generate` as the model's, which hands anything the loop does not run (beam search, assisted decoding,
a dynamic cache, `return_dict_in_generate`, a logits processor or stopping criterion it does not know...) to
transformers' own generate, saying why once. transformers loads this file alone, so it imports nothing of ours.
"""

import copy

import torch
from transformers.generation import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Steps per host round trip. The host's work per block (a graph replay, one device-to-host copy, the streamer) is
# paid once per block while the device idles, so the wall time of a step is its GPU time times
# 1 + host / (block_steps x GPU step); generate()'s whole host work was ~1.5 ms a step, an upper bound for a block's,
# and a K3 decode step 2-6 ms on one H200, so 8 steps keep the overhead under 10% at the fastest step. More steps only
# add to what runs after the last row stopped (at most block_steps - 1 padded steps) and to how many tokens a
# streamer gets at once (8: about 40 ms of text).
DEFAULT_BLOCK_STEPS = 8
# Eager steps before the first capture: the first compiles and allocates, the second runs what the graph will hold
WARM_STEPS = 2

# Processors whose maths the step runs as transformers wrote it: they read only the scores, sync nothing and keep
# shapes, so they trace into the step's graph
SCORE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
# Processors that read the sequence length (eos masked below a minimum length): the step reads a device-side length
LENGTH_GATES = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)
STOPPING_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
LOOP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

_M32 = 0xFFFFFFFF


def generate(*args, model, **kwargs):
    """`model.generate` of a model folder (transformers installs `functools.partial(generate, model=model)`, so the
    model is a keyword and the prompt may come first): the decode loop for a greedy or sampling generation on a
    static cache, transformers' own generate for everything else."""
    reason = call_refusal(model, args, kwargs)
    if reason is not None:
        if reason not in (NOT_STATIC, NOT_ASKED):
            logger.warning_once(f"Kimi K3 decode loop not used ({reason}): transformers' own decode loop runs")
        for key in LOOP_ARGUMENTS:  # the loop's own settings mean nothing to transformers' loop
            kwargs.pop(key, None)
        return type(model).generate(model, *args, **kwargs)
    # transformers hands a custom decoding function only the arguments its signature adds to `_sample`'s, so the
    # streamer goes under our own name (generate() would not put the prompt either: the loop does)
    streamer = kwargs.pop("streamer", None)
    return type(model).generate(model, *args, custom_generate=decode_loop, decode_streamer=streamer, **kwargs)


NOT_STATIC = "the cache is not static"
# Greedy decoding on CUDA was measured (docs/design.md, Decode loop: tokens equal to transformers' compiled loop,
# faster at the wall); sampling in the captured blocks was not, so on CUDA it runs in the loop when a call asks for
# it by giving `decode_block_steps`, and transformers' compiled loop stays its default until then
NOT_ASKED = "on CUDA sampling runs in the loop when decode_block_steps is given"
LOOP_ARGUMENTS = ("decode_block_steps", "decode_compile", "generator")


def _kimi_cache(values):
    """The Kimi K3 cache among keyword arguments, under whichever name this transformers passes it (found by its
    interface: the fixed-shape decode step)."""
    return next((v for v in values if hasattr(v, "is_fixed_shape_step") and hasattr(v, "is_static")), None)


def call_refusal(model, args, kwargs) -> str | None:
    """Why a generate() call does not take the decode loop (None: it does), from what the call asks: the generation
    mode and the cache kind of the generation config it would run with."""
    if kwargs.get("custom_generate") is not None:
        return "custom_generate given"
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)  # generate(inputs, config)
    config = copy.deepcopy(config if config is not None else model.generation_config)
    config.update(**{key: value for key, value in kwargs.items() if key != "generation_config"})
    given = _kimi_cache(kwargs.values())
    if not (config.cache_implementation == "static" or (given is not None and given.is_static)):
        return NOT_STATIC
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in LOOP_MODES:
        return f"generation mode {mode.value}"
    if (mode == GenerationMode.SAMPLE and getattr(model, "device", torch.device("cpu")).type == "cuda"
            and kwargs.get("decode_block_steps") is None):
        return NOT_ASKED
    for key in ("synced_gpus", "tokenizer", "stop_strings", "prefix_allowed_tokens_fn", "negative_prompt_ids"):
        if kwargs.get(key) or getattr(config, key, None):
            return f"{key} given"
    return None


def loop_refusal(model, logits_processor, stopping_criteria, generation_config, model_kwargs) -> str | None:
    """Why the prepared generation (transformers' processors, criteria and config) cannot run in the loop, or None."""
    cache = _kimi_cache(model_kwargs.values())
    if cache is None or not cache.is_static:
        return NOT_STATIC
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate (the loop returns the sequences)"
    for processor in logits_processor:
        if not isinstance(processor, SCORE_PROCESSORS + LENGTH_GATES):
            return f"logits processor {type(processor).__name__}"
    for criterion in stopping_criteria:
        if not isinstance(criterion, STOPPING_CRITERIA):
            return f"stopping criterion {type(criterion).__name__}"
    if stopping_criteria.max_length is None:
        return "no max_length"
    has_eos = any(isinstance(c, EosTokenCriteria) for c in stopping_criteria)
    if has_eos and getattr(cache, "_is_user_defined", False):
        # a block runs on after the last row stopped, and a cache the caller keeps would hold those steps
        return "a cache passed in, with eos ids (the loop may run past the last token)"
    if getattr(model, "experts_cache", None) is not None:
        return "routed experts in host memory"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a model split across devices"
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        return "a model sharded across ranks"
    return None


def decode_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                decode_streamer=None, decode_block_steps: int | None = None, decode_compile: bool | None = None,
                generator: torch.Generator | None = None, **model_kwargs):
    """The decoding function generate() calls in place of `_sample` (`custom_generate=decode_loop`), after its own
    preparation (config, special tokens, cache, processors, criteria). Extra arguments: `decode_block_steps` (steps
    per host round trip, default `DEFAULT_BLOCK_STEPS`), `decode_compile` (compile the step; default: on CUDA unless
    `disable_compile`), `generator` (the seed of the sampling noise is drawn from it, else from torch's default
    generator: `torch.manual_seed` makes a sampled generation reproducible)."""
    mode = generation_config.get_generation_mode()
    if mode not in LOOP_MODES:
        raise ValueError(f"decode_loop runs greedy and sampling generation, not {mode.value}; call generate() "
                         "without custom_generate")
    streamer = decode_streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())
    reason = "synced_gpus" if synced_gpus else loop_refusal(model, logits_processor, stopping_criteria,
                                                            generation_config, model_kwargs)
    if reason is not None:
        logger.warning_once(f"Kimi K3 decode loop not used ({reason}): transformers' own decode loop runs")
        return type(model)._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                   streamer=streamer, **model_kwargs)
    block_steps = DEFAULT_BLOCK_STEPS if decode_block_steps is None else decode_block_steps
    if isinstance(block_steps, bool) or not isinstance(block_steps, int) or block_steps < 1:
        raise ValueError(f"decode_block_steps={block_steps!r}: a whole number of steps >= 1")
    cache = _kimi_cache(model_kwargs.values())
    device = model.get_input_embeddings().weight.device
    if decode_compile is None:
        decode_compile = device.type == "cuda" and not generation_config.disable_compile
    seed = None
    if generation_config.do_sample:
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator).item())
    outputs = model._prefill(input_ids, generation_config, model_kwargs)  # same signature 5.17 through 5.24
    first_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
    del outputs
    loop = DecodeLoop(model, cache, input_ids.shape, first_logits.shape[-1], logits_processor, stopping_criteria,
                      generation_config, seed, block_steps, decode_compile)
    generated = loop.run(first_logits, streamer)
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, generated.to(input_ids.device)], dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# The step


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """PCG's output hash of 32-bit values held in int64: every product stays below 2^63, so it is exact (and the same)
    on every device, eager or compiled."""
    x = (x * 747796405 + 2891336453) & _M32
    word = (((x >> ((x >> 28) + 4)) ^ x) * 277803737) & _M32
    return ((word >> 22) ^ word) & _M32


def row_keys(seed: int, batch: int, device) -> torch.Tensor:
    """[B] per-row keys of the sampling noise, from a 63-bit seed."""
    rows = torch.arange(batch, dtype=torch.long, device=device)
    return _hash32(_hash32(rows ^ (seed & _M32)) ^ ((seed >> 32) & _M32))


def gumbel_noise(keys: torch.Tensor, length: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] standard Gumbel noise, a pure function of the row keys, the sequence length and the token id (no
    generator state: a CUDA graph replays it unchanged and every replay gets new noise). 24-bit uniforms: a token
    more than e^20 times less likely than the top one is never drawn."""
    step_keys = _hash32(keys ^ (length & _M32))
    bits = _hash32(step_keys[:, None] ^ torch.arange(vocab, dtype=torch.long, device=keys.device)[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform))


class TokenChoice:
    """Logits to the next token: transformers' processors in their order (the length gates on a device-side length),
    then argmax, or for sampling argmax of scores + Gumbel noise, which draws from softmax(scores) exactly as
    `torch.multinomial` of generate() does, with counter-based noise. Built once per configuration: the compiled
    step sees the same object, so it does not recompile."""

    def __init__(self, processors, sample: bool):
        self.processors = processors  # score processors as they are, a length gate as None
        self.sample = sample

    def __call__(self, logits, input_ids, length, keys, gates, min_lengths):
        """`gates` [G, V]: the eos ids each length gate masks, `min_lengths` [G] the lengths below which it does."""
        scores, gate = logits, 0
        for processor in self.processors:
            if processor is None:
                blocked = gates[gate][None, :] & (length < min_lengths[gate])[:, None]
                scores = scores.masked_fill(blocked, float("-inf"))
                gate += 1
            else:
                scores = processor(input_ids, scores)
        if self.sample:
            scores = scores + gumbel_noise(keys, length, scores.shape[-1])
        return torch.argmax(scores, dim=-1)


_CHOICES: dict = {}


def token_choice(logits_processor, sample: bool):
    """The `TokenChoice` of these processors (one per configuration, shared by every call), and per length gate its
    eos ids and minimum length (call-specific: they count the prompt; the step reads them as tensors)."""
    spec, processors, gates = [], [], []
    for processor in logits_processor:
        if isinstance(processor, LENGTH_GATES):
            spec.append("length gate")
            processors.append(None)
            gates.append((processor.eos_token_id.reshape(-1),
                          processor.min_length if isinstance(processor, MinLengthLogitsProcessor)
                          else processor.prompt_length_to_skip + processor.min_new_tokens))
        else:
            spec.append((type(processor).__name__, tuple(sorted(vars(processor).items()))))
            processors.append(processor)
    key = (tuple(spec), sample)
    if key not in _CHOICES:
        _CHOICES[key] = TokenChoice(processors, sample)
    return _CHOICES[key], gates


def decode_step(model, cache, choice, tokens, unfinished, length, keys, gates, min_lengths, eos, pad):
    """One decode step, the unit CUDA captures: the forward on the static cache, the token choice, finished rows
    padded and the stop flags. Returns (next tokens [B], rows still running [B])."""
    logits = model(input_ids=tokens, cache=cache, use_cache=True).logits[:, -1].float()
    return finish(choice(logits, tokens, length, keys, gates, min_lengths), unfinished, eos, pad)


def finish(next_tokens, unfinished, eos, pad):
    """transformers' stop rule: a finished row gets the pad token, a row stops at an eos id."""
    if eos is None:
        return next_tokens, unfinished
    next_tokens = torch.where(unfinished, next_tokens, pad)
    return next_tokens, unfinished & ~torch.isin(next_tokens, eos)


_COMPILED_STEP = None


def compiled_decode_step():
    """`decode_step` compiled once per process (one graph, no break: it must be capturable), shared by every model
    and call: guards tell the configurations apart."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        _COMPILED_STEP = torch.compile(decode_step, fullgraph=True, dynamic=False)
    return _COMPILED_STEP


# ----------------------------------------------------------------------------------------------------------------
# The loop


class DecodeLoop:
    """The state of one generation in fixed-address device buffers (last tokens, running rows, length, a record of
    the block's tokens and running counts) and the host loop that runs blocks of steps and reads each block once."""

    def __init__(self, model, cache, prompt_shape, vocab, logits_processor, stopping_criteria, generation_config,
                 seed, block_steps, compiled):
        batch, prompt_length = prompt_shape
        device = model.get_input_embeddings().weight.device
        self.model, self.cache, self.batch, self.block_steps = model, cache, batch, block_steps
        self.steps_allowed = stopping_criteria.max_length - prompt_length  # tokens to generate at most
        self.choice, gates = token_choice(logits_processor, seed is not None)
        self.gates = torch.zeros(len(gates), vocab, dtype=torch.bool, device=device)
        for index, (eos_ids, _) in enumerate(gates):
            self.gates[index, eos_ids.to(device)] = True
        self.min_lengths = torch.tensor([length for _, length in gates], dtype=torch.long, device=device)
        eos = [c.eos_token_id.reshape(-1) for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.eos = torch.cat(eos).to(device) if eos else None
        pad = generation_config._pad_token_tensor
        self.pad = None if self.eos is None else pad.to(device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.length = torch.full((1,), prompt_length, dtype=torch.long, device=device)
        self.keys = row_keys(0 if seed is None else seed, batch, device)
        self.row = torch.zeros(1, dtype=torch.long, device=device)
        self.record = torch.zeros(block_steps, batch + 1, dtype=torch.long, device=device)
        self.step_fn = compiled_decode_step() if compiled else decode_step
        self.use_graph = compiled and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps_run = 0

    def _record(self, next_tokens, unfinished):
        self.tokens.copy_(next_tokens[:, None])
        self.unfinished.copy_(unfinished)
        self.length.add_(1)
        entry = torch.cat([next_tokens, unfinished.sum().reshape(1)])
        self.record.index_copy_(0, self.row, entry[None])
        self.row.add_(1)

    def step(self):
        self._record(*self.step_fn(self.model, self.cache, self.choice, self.tokens, self.unfinished, self.length,
                                   self.keys, self.gates, self.min_lengths, self.eos, self.pad))

    def _run_steps(self, count: int) -> None:
        if not self.use_graph or self.steps_run < WARM_STEPS:
            self._eager_steps(count)
        else:
            # a full block is one graph; a shorter tail, replays of the one-step graph
            size = count if count == self.block_steps else 1
            if size not in self.graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(size):
                        self.step()
                self.graphs[size] = graph
            for _ in range(count // size):
                self.graphs[size].replay()
        self.steps_run += count

    def _eager_steps(self, count: int) -> None:
        if not self.use_graph:
            for _ in range(count):
                self.step()
            return
        side = torch.cuda.Stream()  # warm-up on a side stream, as a capture's warm-up must be
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(count):
                self.step()
        torch.cuda.current_stream().wait_stream(side)

    def _read(self, count: int, streamer, out: list) -> bool:
        """The block's tokens to the host (one copy, the block's one synchronisation) and the streamer, up to the
        step where no row ran any more; whether generation goes on."""
        rows = self.record[:count].tolist()
        for row in rows:
            tokens = torch.tensor(row[:-1], dtype=torch.long)
            out.append(tokens)
            if streamer is not None:
                streamer.put(tokens)
            if row[-1] == 0:
                return False
        return True

    @torch.no_grad()
    def run(self, first_logits, streamer) -> torch.Tensor:
        """[B, n] generated tokens (host), from the prefill's last logits on."""
        out: list[torch.Tensor] = []
        self.row.zero_()
        first = self.choice(first_logits, self.tokens, self.length, self.keys, self.gates, self.min_lengths)
        self._record(*finish(first, self.unfinished, self.eos, self.pad))
        going = self._read(1, streamer, out)
        left = self.steps_allowed - 1
        while going and left > 0:
            count = min(self.block_steps, left)
            self.row.zero_()
            self._run_steps(count)
            going = self._read(count, streamer, out)
            left -= count
        return torch.stack(out, dim=1)
