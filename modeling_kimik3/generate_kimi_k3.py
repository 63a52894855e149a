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

Speculative decoding runs in the same loop (docs/design.md, Decode loop): with `assistant_model=draft` (a K3 model:
its own static cache) or `prompt_lookup_num_tokens=k` (an n-gram match over the token history, on the device), a
greedy generation on a static cache runs rounds of k proposals, one verify of k + 1 tokens on the target, greedy
acceptance and the rewind of both caches to the kept tokens, all device-side with fixed shapes (the caches'
`begin_round` / `rewind_round`); on CUDA a round is compiled and captured like a block of steps.

A model folder carries this file as `custom_generate/generate.py`: `from_pretrained(..., trust_remote_code=True)`
installs its `generate` as the model's, which hands anything the loop does not run (beam search, assisted decoding,
a dynamic cache, `return_dict_in_generate`, a logits processor or stopping criterion it does not know...) to
transformers' own generate, saying why once. transformers loads this file alone, so it imports nothing of ours.
"""

import collections
import copy
import math
import time
import weakref

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
    speculation = _speculation_arguments(model, args, kwargs)
    return type(model).generate(model, *args, custom_generate=decode_loop, decode_streamer=streamer, **speculation,
                                **kwargs)


# Proposals per speculative round with a draft model when the call does not say (`num_assistant_tokens`): a verify
# of 5 tokens; transformers' own default (20, with a schedule) is for rounds whose width may change, ours is fixed
DEFAULT_DRAFT_TOKENS = 4
# transformers' default longest n-gram of prompt lookup (`max_matching_ngram_size`)
DEFAULT_LOOKUP_NGRAM = 2


def _speculation_arguments(model, args, kwargs) -> dict:
    """Moves a speculative call's settings (`assistant_model`, `num_assistant_tokens`, `prompt_lookup_num_tokens`,
    `max_matching_ngram_size`) from `kwargs` to the loop's arguments (`decode_draft`, `decode_proposals`,
    `decode_lookup_ngram`): transformers' assisted loop is not run. {} for a call that is not speculative."""
    config = _call_config(model, args, kwargs)
    draft = kwargs.pop("assistant_model", None)
    lookup = kwargs.pop("prompt_lookup_num_tokens", None)
    lookup = config.prompt_lookup_num_tokens if lookup is None else lookup
    draft_tokens = kwargs.pop("num_assistant_tokens", None)
    ngram = kwargs.pop("max_matching_ngram_size", None) or config.max_matching_ngram_size
    if draft is None and lookup is None:
        return {}
    if draft is not None:
        return {"decode_draft": draft, "decode_proposals": draft_tokens or DEFAULT_DRAFT_TOKENS}
    return {"decode_proposals": lookup, "decode_lookup_ngram": ngram or DEFAULT_LOOKUP_NGRAM}


NOT_STATIC = "the cache is not static"
# Greedy decoding on CUDA was measured (docs/design.md, Decode loop: tokens equal to transformers' compiled loop,
# faster at the wall); sampling in the captured blocks was not, so on CUDA it runs in the loop when a call asks for
# it by giving `decode_block_steps`, and transformers' compiled loop stays its default until then
NOT_ASKED = "on CUDA sampling runs in the loop when decode_block_steps is given"
LOOP_ARGUMENTS = ("decode_block_steps", "decode_compile", "generator", "decode_report", "decode_fallback")


def _kimi_cache(values):
    """The Kimi K3 cache among keyword arguments, under whichever name this transformers passes it (found by its
    interface: the fixed-shape decode step)."""
    return next((v for v in values if hasattr(v, "is_fixed_shape_step") and hasattr(v, "is_static")), None)


def call_refusal(model, args, kwargs) -> str | None:
    """Why a generate() call does not take the decode loop (None: it does), from what the call asks: the generation
    mode and the cache kind of the generation config it would run with."""
    if kwargs.get("custom_generate") is not None:
        return "custom_generate given"
    config = _call_config(model, args, kwargs)
    given = _kimi_cache(kwargs.values())
    if not (config.cache_implementation == "static" or (given is not None and given.is_static)):
        return NOT_STATIC
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode == GenerationMode.ASSISTED_GENERATION:
        if config.do_sample:
            return "speculative sampling (the loop's speculative rounds are greedy)"
        for key in ("assistant_tokenizer", "assistant_early_exit"):
            if kwargs.get(key) is not None or getattr(config, key, None) is not None:
                return f"{key} given"
        mode = GenerationMode.GREEDY_SEARCH
    if mode not in LOOP_MODES:
        return f"generation mode {mode.value}"
    if (mode == GenerationMode.SAMPLE and getattr(model, "device", torch.device("cpu")).type == "cuda"
            and kwargs.get("decode_block_steps") is None):
        return NOT_ASKED
    for key in ("synced_gpus", "tokenizer", "stop_strings", "prefix_allowed_tokens_fn", "negative_prompt_ids"):
        if kwargs.get(key) or getattr(config, key, None):
            return f"{key} given"
    return None


def _call_config(model, args, kwargs):
    """The generation config a call would run with (its own, or the model's, updated by the call's keywords)."""
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)  # generate(inputs, config)
    config = copy.deepcopy(config if config is not None else model.generation_config)
    config.update(**{key: value for key, value in kwargs.items()
                     if key not in ("generation_config", "assistant_model")})
    return config


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
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a model split across devices"
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        return "a model sharded across ranks"
    return None


def decode_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                decode_streamer=None, decode_block_steps: int | None = None, decode_compile: bool | None = None,
                generator: torch.Generator | None = None, decode_draft=None, decode_proposals: int | None = None,
                decode_lookup_ngram: int | None = None, decode_fallback: bool = True, decode_report: dict | None = None,
                **model_kwargs):
    """The decoding function generate() calls in place of `_sample` (`custom_generate=decode_loop`), after its own
    preparation (config, special tokens, cache, processors, criteria). Extra arguments: `decode_block_steps` (steps
    per host round trip, default `DEFAULT_BLOCK_STEPS`; speculative rounds per host round trip, default one per
    `DEFAULT_BLOCK_STEPS` verified tokens), `decode_compile` (compile the step; default: on CUDA unless
    `disable_compile`), `generator` (the seed of the sampling noise is drawn from it, else from torch's default
    generator: `torch.manual_seed` makes a sampled generation reproducible). Speculative decoding (greedy):
    `decode_draft` (the draft model), `decode_proposals` (tokens proposed per round), `decode_lookup_ngram` (prompt
    lookup's longest n-gram, without a draft model), `decode_fallback` (plain steps while the rounds give fewer
    tokens per second at the wall, with a retry now and then; False: rounds throughout); `decode_report`, a dict
    the loop fills with its rounds, accepted tokens, plain steps and fallbacks."""
    speculative = decode_draft is not None or decode_proposals is not None
    mode = generation_config.get_generation_mode()
    if speculative and mode == GenerationMode.ASSISTED_GENERATION and not generation_config.do_sample:
        mode = GenerationMode.GREEDY_SEARCH
    if speculative and mode != GenerationMode.GREEDY_SEARCH:
        raise ValueError(f"decode_loop's speculative rounds are greedy, not {mode.value}")
    if mode not in LOOP_MODES:
        raise ValueError(f"decode_loop runs greedy and sampling generation, not {mode.value}; call generate() "
                         "without custom_generate")
    streamer = decode_streamer
    if streamer is not None:
        streamer.put(input_ids.cpu())
    reason = "synced_gpus" if synced_gpus else loop_refusal(model, logits_processor, stopping_criteria,
                                                            generation_config, model_kwargs)
    if reason is None and speculative and _rounds_read_routes(model, decode_draft, input_ids.shape[0],
                                                              decode_proposals):
        # a round is captured whole, and the host would read each layer's routes inside it
        reason = "speculative rounds with routed experts in host memory whose routes the host reads"
    if reason is None and speculative:
        reason = speculation_refusal(model, decode_draft, decode_proposals, logits_processor)
        if reason is not None:
            raise ValueError(f"Kimi K3 speculative decoding on a static cache: {reason}")
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
    if speculative:
        if decode_block_steps is None:
            block_steps = max(1, DEFAULT_BLOCK_STEPS // (decode_proposals + 1))
        proposer = (ModelDraft(decode_draft, cache, input_ids, model_kwargs.get("attention_mask"))
                    if decode_draft is not None else PromptLookup(decode_lookup_ngram or DEFAULT_LOOKUP_NGRAM))
        loop = SpeculativeLoop(model, cache, input_ids, first_logits.shape[-1], logits_processor, stopping_criteria,
                               generation_config, block_steps, decode_compile, proposer, decode_proposals,
                               decode_fallback)
    else:
        loop = DecodeLoop(model, cache, input_ids.shape, first_logits.shape[-1], logits_processor,
                          stopping_criteria, generation_config, seed, block_steps, decode_compile)
    generated = loop.run(first_logits, streamer)
    if decode_report is not None:
        decode_report.update(loop.report())
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, generated.to(input_ids.device)], dim=-1)


def speculation_refusal(model, draft, proposals, logits_processor) -> str | None:
    """Why a greedy generation cannot run speculative rounds (an error: the call asked for them), or None."""
    if isinstance(proposals, bool) or not isinstance(proposals, int) or proposals < 1:
        return f"{proposals!r} proposals per round (a whole number >= 1: num_assistant_tokens, " \
               "prompt_lookup_num_tokens)"
    for processor in logits_processor:
        if not isinstance(processor, LENGTH_GATES):
            return f"logits processor {type(processor).__name__} (the rounds choose by argmax and the length gates)"
    if draft is None:
        return None
    config = getattr(draft, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(draft, "get_input_embeddings") or not all(
            hasattr(text, key) for key in ("layer_types", "kv_lora_rank", "linear_num_heads")):
        return (f"the draft ({type(draft).__name__}) is not a Kimi K3 model (a round runs it on a Kimi K3 static "
                "cache)")
    target_vocab = model.get_input_embeddings().weight.shape[0]
    draft_vocab = draft.get_input_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        return (f"the draft's vocabulary ({draft_vocab} ids) is not the target's ({target_vocab}): its proposals "
                "would be other tokens")
    devices = (draft.get_input_embeddings().weight.device, model.get_input_embeddings().weight.device)
    if devices[0] != devices[1]:
        return f"the draft is on {devices[0]}, the target on {devices[1]} (a round runs both on one device)"
    return None


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


_PIECEWISE_STEP = None
# how the piecewise step compiles: inductor's pieces, each captured and replayed by torch's cudagraph trees (which
# keep the weights and the static cache's buffers in place and let a piece write the cache)
PIECEWISE_OPTIONS = {"mode": "reduce-overhead"}


def _experts_off_device(model) -> bool:
    """Whether the model keeps its routed experts in host memory (`experts_offload`)."""
    return getattr(model, "experts_cache", None) is not None


def _routes_read_by_host(model, batch: int) -> bool:
    """Whether some MoE layer of a model with its experts in host memory has the host read its routes during a
    decode step of `batch` rows, so that the step cannot be one graph; the layers that compute their routes in the
    stream's order instead (offload_kimi_k3.LayerOffload.streams) get what their step uses made here, before any
    compile traces it."""
    if not _experts_off_device(model):
        return False
    embeddings = model.get_input_embeddings().weight
    modules = [m for m in model.modules() if getattr(m, "offload", None) is not None and hasattr(m, "prepare_stream")]
    return not all([m.prepare_stream(batch, embeddings.dtype, embeddings.device) for m in modules])


def _recompile_limits(per_frame: int, overall: int) -> dict:
    """dynamo's recompile limits under the names this torch has (`cache_size_limit` before torch 2.6)."""
    config = torch._dynamo.config
    per_name = next(n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n))
    limits = {per_name: per_frame}
    overall_name = next((n for n in ("accumulated_recompile_limit", "accumulated_cache_size_limit")
                         if hasattr(config, n)), None)
    if overall_name is not None:
        limits[overall_name] = overall
    return limits


def _rounds_read_routes(model, draft, batch: int, proposals: int) -> bool:
    """Whether the host would read routes inside a speculative round or a plain block (`_routes_read_by_host`): the
    target's verify of `proposals` + 1 tokens a row and its plain steps, the draft's steps."""
    return (_routes_read_by_host(model, batch) or _routes_read_by_host(model, batch * (proposals + 1))
            or (draft is not None and _routes_read_by_host(draft, batch)))


def piecewise_decode_step():
    """`decode_step` for a model whose routed experts live in host memory, compiled once per process: the expert
    module's offloaded calls (where the host reads the routes, moves experts, starts the CPU's share) are
    `torch.compiler.disable`d, so the step breaks its graph there and nowhere else, and torch's cudagraph trees
    capture each piece between two reads as a CUDA graph and replay it (`PIECEWISE_OPTIONS`). Each layer is its own
    compiled frame (the cache is indexed by its number), hence the recompile limits scaled by the layers."""
    global _PIECEWISE_STEP
    if _PIECEWISE_STEP is None:
        compiled = torch.compile(decode_step, dynamic=False, **PIECEWISE_OPTIONS)

        def step(model, *args):
            layers = model.config.get_text_config().num_hidden_layers
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were copied out: reuse them
            with torch._dynamo.config.patch(_recompile_limits(4 * layers + 8, 16 * layers + 256)):
                return compiled(model, *args)

        _PIECEWISE_STEP = step
    return _PIECEWISE_STEP


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
        piecewise = _routes_read_by_host(model, batch)
        self.step_fn = decode_step if not compiled else piecewise_decode_step() if piecewise \
            else compiled_decode_step()
        # a step whose host reads routes is captured piece by piece (its compiled step's own graphs), not whole
        self.use_graph = compiled and device.type == "cuda" and not piecewise
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
        self._run_units(self.step, count, self.block_steps, self.graphs, self.steps_run >= WARM_STEPS)
        self.steps_run += count

    def _run_units(self, unit, count: int, block: int, graphs: dict, warm: bool) -> bool:
        """`count` runs of `unit` (a decode step or a speculative round): eagerly off CUDA graphs, and while not
        `warm` on a side stream (as a capture's warm-up must be); else from CUDA graphs, a full block of `block`
        units one graph, a shorter tail replays of the one-unit graph. Whether they ran as they will from now on
        (warm, nothing captured)."""
        if not self.use_graph:
            for _ in range(count):
                unit()
            return warm
        if not warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(count):
                    unit()
            torch.cuda.current_stream().wait_stream(side)
            return False
        size = count if count == block else 1
        clean = size in graphs
        if not clean:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(size):
                    unit()
            graphs[size] = graph
        for _ in range(count // size):
            graphs[size].replay()
        return clean

    @staticmethod
    def _emit(row: list, streamer, out: list) -> None:
        """One step's tokens (a host list, one per row) to the output and the streamer."""
        tokens = torch.tensor(row, dtype=torch.long)
        out.append(tokens)
        if streamer is not None:
            streamer.put(tokens)

    def _read(self, count: int, streamer, out: list) -> bool:
        """The block's tokens to the host (one copy, the block's one synchronisation) and the streamer, up to the
        step where no row ran any more; whether generation goes on."""
        rows = self.record[:count].tolist()
        for row in rows:
            self._emit(row[:-1], streamer, out)
            if row[-1] == 0:
                return False
        return True

    @torch.no_grad()
    def run(self, first_logits, streamer) -> torch.Tensor:
        """[B, n] generated tokens (host), from the prefill's last logits on."""
        out: list[torch.Tensor] = []
        self._plain_blocks(self._first_token(first_logits, streamer, out), streamer, out)
        return torch.stack(out, dim=1)

    def _first_token(self, first_logits, streamer, out: list) -> bool:
        """The token chosen from the prefill's logits, recorded and read; whether generation goes on."""
        self.row.zero_()
        first = self.choice(first_logits, self.tokens, self.length, self.keys, self.gates, self.min_lengths)
        self._record(*finish(first, self.unfinished, self.eos, self.pad))
        return self._read(1, streamer, out)

    def _plain_blocks(self, going: bool, streamer, out: list) -> None:
        """Blocks of plain steps up to the tokens allowed or the step where no row runs any more."""
        left = self.steps_allowed - len(out)
        while going and left > 0:
            count = min(self.block_steps, left)
            self.row.zero_()
            self._run_steps(count)
            going = self._read(count, streamer, out)
            left -= count

    def report(self) -> dict:
        return {"steps": self.steps_run}


# ----------------------------------------------------------------------------------------------------------------
# Speculative rounds (docs/design.md, Decode loop; the rewind: Rewinding)


class ModelDraft:
    """Proposals from a draft model on its own static cache (a cache of the target's kind and length, prefilled with
    the prompt here). A round runs k + 1 one-token steps: the last feeds the k-th proposal, so the draft's cache holds
    every token the target may keep, and the rewind to the kept ones is the cache's own."""

    def __init__(self, draft, cache, input_ids, attention_mask):
        self.model = draft
        self.judge_key = ("draft", id(draft))  # the fallback's round times are per proposer (WallJudge)
        self.cache = type(cache)(draft.config, max_cache_len=cache.max_cache_len)
        with torch.no_grad():
            draft(input_ids=input_ids, attention_mask=attention_mask, cache=self.cache, use_cache=True)

    def start(self, width: int) -> None:
        self.cache.enable_rewind(width)

    def catch_up(self, history: torch.Tensor, start: int, count: int) -> None:
        """The tokens the target ran as plain steps (history positions start .. start + count - 1), in one
        forward: only the proposals depend on them."""
        self.model(input_ids=history[:, start: start + count], cache=self.cache, use_cache=True)

    def __call__(self, choice, last, length, history, gates, min_lengths, proposals: int) -> torch.Tensor:
        self.cache.begin_round()
        tokens, out = last, []
        for index in range(proposals):
            logits = self.model(input_ids=tokens, cache=self.cache, use_cache=True).logits[:, -1].float()
            tokens = choice(logits, tokens, length + index, None, gates, min_lengths)[:, None]
            out.append(tokens)
        # the k-th proposal into the cache: the decoder alone, its logits would not be read (the LM head is a large
        # share of a small draft's step)
        self.model.get_decoder()(input_ids=tokens, cache=self.cache, use_cache=True)
        return torch.cat(out, dim=1)

    def rewind_round(self, keep: torch.Tensor) -> None:
        self.cache.rewind_round(keep)


class PromptLookup:
    """Proposals by prompt lookup, on the device with fixed shapes: the latest earlier occurrence of the history's
    last n tokens (n from `ngram` down to 1, the longest that occurs) and the k tokens after it. With no match the
    proposal is whatever the history holds there: it is only rejected."""

    def __init__(self, ngram: int):
        if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
            raise ValueError(f"Kimi K3 prompt lookup: max_matching_ngram_size={ngram!r} (a whole number >= 1)")
        self.ngram = ngram
        self.judge_key = ("lookup", ngram)

    def start(self, width: int) -> None:
        pass

    def catch_up(self, history: torch.Tensor, start: int, count: int) -> None:
        pass

    def __call__(self, choice, last, length, history, gates, min_lengths, proposals: int) -> torch.Tensor:
        batch, size = history.shape
        device = history.device
        start = torch.full((batch,), -1, dtype=torch.long, device=device)
        found = torch.zeros(batch, dtype=torch.bool, device=device)
        for n in range(self.ngram, 0, -1):
            suffix = history.index_select(1, (length - n + torch.arange(n, device=device)).clamp(min=0))
            starts = torch.arange(size - n + 1, device=device)
            # an occurrence before the suffix itself, with a token after it
            valid = (starts + n <= length - 1) & (length >= n)
            hit = (history.unfold(1, n, 1) == suffix[:, None, :]).all(dim=-1) & valid[None, :]
            latest = torch.where(hit, starts[None, :], -1).amax(dim=1)
            use = ~found & (latest >= 0)
            start = torch.where(use, latest + n, start)
            found = found | use
        index = (start[:, None] + torch.arange(proposals, device=device)[None, :]).clamp(0, size - 1)
        return history.gather(1, index)

    def rewind_round(self, keep: torch.Tensor) -> None:
        pass


def speculative_round(model, cache, proposer, choice, last, unfinished, length, history, gates, min_lengths, eos,
                      pad, proposals: int):
    """One round, the unit CUDA captures: k proposals, the target's verify of [last, proposals] (k + 1 tokens, one
    fixed-shape forward), greedy acceptance of the leading proposals the target would have chosen (the minimum over
    the running rows), both caches rolled back to the round's kept tokens (the last one and the accepted proposals).
    The tokens of the round are the target's choices up to the first rejection, inclusive: the accepted proposals
    are the target's own choices. Returns (tokens [B, k + 1], running rows after each [k + 1], tokens emitted [1],
    rows running after the round [B])."""
    width = proposals + 1
    cache.begin_round()
    proposed = proposer(choice, last, length, history, gates, min_lengths, proposals)
    logits = model(input_ids=torch.cat([last, proposed], dim=1), cache=cache, use_cache=True).logits.float()
    batch = last.shape[0]
    offsets = torch.arange(width, device=last.device)
    lengths = (length + offsets).repeat(batch)  # row-major [B * (k + 1)]: the length each choice is made at
    chosen = choice(logits.reshape(batch * width, -1), None, lengths, None, gates, min_lengths).view(batch, width)
    agree = (proposed == chosen[:, :-1]) | ~unfinished[:, None]  # a finished row accepts anything
    # the leading agreements of each row: the first disagreement's index (k where none), a min with no tie and no
    # scan (the compiled round's int64 cumprod of the agreements gave 168 of 3 proposals on CUDA)
    first_reject = torch.where(agree, proposals, torch.arange(proposals, device=agree.device)).amin(dim=1)
    keep = first_reject.amin().reshape(1) + 1
    cache.rewind_round(keep)
    proposer.rewind_round(keep)
    tokens, running = [], []
    for index in range(width):
        token = chosen[:, index]
        if eos is not None:
            token = torch.where(unfinished, token, pad)
            emitted = offsets[index] < keep
            unfinished = torch.where(emitted, unfinished & ~torch.isin(token, eos), unfinished)
        tokens.append(token)
        running.append(unfinished.sum())
    return torch.stack(tokens, dim=1), torch.stack(running), keep, unfinished


_COMPILED_ROUND = None


def compiled_speculative_round():
    """`speculative_round` compiled once per process (one graph: it must be capturable)."""
    global _COMPILED_ROUND
    if _COMPILED_ROUND is None:
        _COMPILED_ROUND = torch.compile(speculative_round, fullgraph=True, dynamic=False)
    return _COMPILED_ROUND


# While the rounds are slower at the wall than plain steps (low acceptance), plain blocks run, and a round is tried
# again after this many of them, twice as many after every try that was still slower, up to MAX_PROBE_GAP: at 0%
# acceptance the tries cost a few percent of the plain speed at first and ever less (docs/design.md, Decode loop)
PROBE_GAP = 4
MAX_PROBE_GAP = 64
# The rounds' tokens are judged over this many of the latest rounds: one round gives 1 to k + 1 tokens, so at 90%
# acceptance one round in ten gives a single token, and a verdict on it alone sent whole calls to plain blocks
ROUNDS_JUDGED = 16

# What the fallback measured at the wall, per model, kept across calls: plain blocks' tokens per second per decode
# shape (batch, cache length, block steps, graphs) and a round's seconds per shape and proposer. A call whose shape
# an earlier call timed judges its rounds without timing plain blocks again, and from its warm-up rounds' tokens
# without capturing rounds first (at 0% acceptance the capture and a timed round cost more than they would save)
_WALL_FIGURES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class WallJudge:
    """Whether the speculative rounds give fewer tokens per second at the wall than plain blocks. A round's time is
    the mean of this call's clean round blocks' (a round has a fixed shape: its time does not depend on what it
    accepts), else an earlier call's; its tokens are the mean of the latest `ROUNDS_JUDGED` rounds', warm-up rounds
    included (their tokens are real, only their time is not), judged from `WARM_STEPS` rounds on. The plain rate is
    the clean plain blocks' (this call's, else an earlier call's of the same model and shape)."""

    def __init__(self, model, shape: tuple, proposer: tuple):
        self.known = _WALL_FIGURES.setdefault(model, {})
        self.plain_key, self.round_key = ("plain", *shape), ("round", *shape, *proposer)
        self.kept: "collections.deque[int]" = collections.deque(maxlen=ROUNDS_JUDGED)
        self.round_seconds, self.timed_rounds = 0.0, 0
        self.plain_seconds, self.plain_tokens = 0.0, 0

    def rounds(self, kept: list, seconds: float | None) -> None:
        """A block of rounds: each round's emitted tokens, and the block's seconds (None: not clean)."""
        self.kept.extend(kept)
        if seconds is not None:
            self.round_seconds += seconds
            self.timed_rounds += len(kept)
            self.known[self.round_key] = self.round_seconds / self.timed_rounds

    def plain(self, tokens: int, seconds: float) -> None:
        """A clean block of plain steps."""
        self.plain_seconds += seconds
        self.plain_tokens += tokens
        self.known[self.plain_key] = self.plain_tokens / max(self.plain_seconds, 1e-9)

    def round_rate(self, optimistic: bool = False) -> float | None:
        """Tokens per second of the rounds; `optimistic`: with the mean of the judged rounds' tokens raised by its
        standard error. A round gives 1 to k + 1 tokens, so at 30-50% acceptance a few early rounds that kept one
        token each say little, and a verdict on their mean alone sends calls to plain blocks where the rounds are
        faster; at 0% every round gives one token, the error is 0 and the verdict comes as soon."""
        seconds = self.known.get(self.round_key)
        count = len(self.kept)
        if seconds is None or count < WARM_STEPS:
            return None
        mean = sum(self.kept) / count
        if optimistic and count > 1:
            mean += math.sqrt(sum((kept - mean) ** 2 for kept in self.kept) / (count - 1) / count)
        return mean / seconds

    def plain_rate(self) -> float | None:
        return self.known.get(self.plain_key)


class SpeculativeLoop(DecodeLoop):
    """The decode loop with speculative rounds: `block_rounds` rounds per host read, each round's tokens and counts
    in a record the host reads once per block. A round writes up to k + 1 cache positions before its rewind, so
    the rounds run while both caches have room for them; the last tokens are plain decode steps. With `fallback`,
    the host times every block that neither compiled nor captured (the read at its end synchronises) and runs plain
    blocks of `DEFAULT_BLOCK_STEPS` steps while they give more tokens per second than the rounds; a draft model's
    cache catches up with the plain blocks' tokens (one forward) before the next round."""

    def __init__(self, model, cache, input_ids, vocab, logits_processor, stopping_criteria, generation_config,
                 block_rounds, compiled, proposer, proposals, fallback):
        super().__init__(model, cache, input_ids.shape, vocab, logits_processor, stopping_criteria,
                         generation_config, None, DEFAULT_BLOCK_STEPS, compiled)
        self.proposer, self.proposals, self.width = proposer, proposals, proposals + 1
        self.block_rounds, self.fallback = block_rounds, fallback
        batch, prompt_length = input_ids.shape
        device = self.tokens.device
        self.prompt_length = prompt_length
        # the token history (prompt lookup and a draft's catch-up read it): room for a block of rounds past max_length
        self.history = torch.zeros(batch, stopping_criteria.max_length + block_rounds * self.width,
                                   dtype=torch.long, device=device)
        self.history[:, :prompt_length] = input_ids.to(device)
        self.round_record = torch.zeros(block_rounds, self.width, batch + 2, dtype=torch.long, device=device)
        self.round_fn = compiled_speculative_round() if compiled else speculative_round
        self.round_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.rounds_run = self.accepted = self.fallbacks = 0
        self.last_kept: list = []  # the last block's tokens per round (the fallback's judge reads them)

    def _record(self, next_tokens, unfinished):
        self.history.index_copy_(1, self.length, next_tokens[:, None])
        super()._record(next_tokens, unfinished)

    def round(self):
        tokens, running, keep, unfinished = self.round_fn(
            self.model, self.cache, self.proposer, self.choice, self.tokens, self.unfinished, self.length,
            self.history, self.gates, self.min_lengths, self.eos, self.pad, self.proposals)
        self.history.index_copy_(1, self.length + torch.arange(self.width, device=self.length.device), tokens)
        self.tokens.copy_(tokens.gather(1, (keep - 1).expand(tokens.shape[0])[:, None]))
        self.unfinished.copy_(unfinished)
        self.length.add_(keep)
        entry = torch.cat([tokens.T, running[:, None], keep.expand(self.width)[:, None]], dim=1)
        self.round_record.index_copy_(0, self.row, entry[None])
        self.row.add_(1)

    def _run_rounds(self, count: int) -> bool:
        """Runs `count` rounds; whether they ran as they will run from now on (no compilation, no capture)."""
        clean = self._run_units(self.round, count, self.block_rounds, self.round_graphs,
                                self.rounds_run >= WARM_STEPS)
        self.rounds_run += count
        return clean

    def _read_rounds(self, count: int, streamer, out: list, limit: int) -> bool:
        """The block's rounds to the host (one copy) and the streamer, token by token, up to `limit` tokens or the
        step where no row ran any more; whether generation goes on."""
        entries = self.round_record[:count].tolist()
        self.accepted += sum(entry[0][-1] - 1 for entry in entries)
        self.last_kept = [entry[0][-1] for entry in entries]
        for entry in entries:
            for row in entry[: entry[0][-1]]:
                if len(out) >= limit:
                    return False
                self._emit(row[:-2], streamer, out)
                if row[-2] == 0:
                    return False
        return len(out) < limit

    def rounds_are_slower(self, round_rate: float | None, plain_rate: float | None) -> bool:
        """The fallback's test, on `WallJudge`'s tokens per second at the wall."""
        return round_rate is not None and plain_rate is not None and round_rate < plain_rate

    @torch.no_grad()
    def run(self, first_logits, streamer) -> torch.Tensor:
        out: list[torch.Tensor] = []
        going = self._first_token(first_logits, streamer, out)
        self.cache.enable_rewind(self.width)
        self.proposer.start(self.width)
        judge = WallJudge(self.model, (self.batch, self.cache.max_cache_len, self.block_steps, self.use_graph),
                          (*self.proposer.judge_key, self.proposals))
        plain_blocks, gap, behind = 0, PROBE_GAP, 0  # plain blocks to run; the proposer's missed tokens
        while going and len(out) < self.steps_allowed:
            # cached tokens = prompt + generated - 1 (the last token is fed by the next round or step)
            cached = self.prompt_length + len(out) - 1
            room = (self.cache.max_cache_len - cached) // self.width
            rounds = min(self.block_rounds, room, self.steps_allowed - len(out))
            if rounds < 1:
                break
            before, start = len(out), time.perf_counter()
            if plain_blocks == 0:
                if behind:
                    self.proposer.catch_up(self.history, cached - behind, behind)
                    behind, start = 0, time.perf_counter()
                self.row.zero_()
                clean = self._run_rounds(rounds)
                going = self._read_rounds(rounds, streamer, out, self.steps_allowed)
                mode = "rounds"
            else:
                steps = min(self.block_steps, self.steps_allowed - len(out))
                clean = self.steps_run >= WARM_STEPS and (not self.use_graph or steps in self.graphs)
                self.row.zero_()
                self._run_steps(steps)
                going = self._read(steps, streamer, out)
                behind += steps
                plain_blocks -= 1
                mode = "plain"
            if not self.fallback:
                continue
            seconds = time.perf_counter() - start if clean else None
            if mode == "plain":
                if seconds is not None:
                    judge.plain(len(out) - before, seconds)
                continue
            judge.rounds(self.last_kept, seconds)
            if judge.round_rate() is None:
                continue
            if judge.plain_rate() is None:
                if plain_blocks == 0:
                    plain_blocks = WARM_STEPS + 1  # time plain blocks once: warm-up, capture, a clean one
            elif self.rounds_are_slower(judge.round_rate(optimistic=True), judge.plain_rate()):
                plain_blocks, gap = gap, min(2 * gap, MAX_PROBE_GAP)
                self.fallbacks += 1
            else:
                gap = PROBE_GAP
        self._plain_blocks(going, streamer, out)
        return torch.stack(out, dim=1)

    def report(self) -> dict:
        """Rounds run, tokens proposed and accepted (the rounds' emitted tokens less one each), plain steps, and
        how often the fallback switched to plain blocks."""
        rounds = self.rounds_run
        return {"rounds": rounds, "proposed": rounds * self.proposals, "steps": self.steps_run,
                "accepted": self.accepted, "fallbacks": self.fallbacks}