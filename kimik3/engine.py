"""The engine of `kimik3 serve` (kimik3/serve.py; docs/design.md, Serving): one thread runs steps. Each prompt is read
in `--prefill-chunk` pieces on its own cache, one piece a step, and every request past its prompt advances by one
token in one batched decode forward over a paged cache (`KimiK3PagedCache`: MLA latents in pages of `--block-size`
tokens, read through each row's block table; KDA states in per-row slots); requests join the batch when their prompt
is read and leave when they finish or their client goes away. A greedy request's tokens are those of `generate()` on
it alone. Prompts start from the prefix store where an earlier prompt or a 512-token block of one matches. Sequences
beyond `--max-requests` are refused by name (`ServeError` 429); under `--max-cache-bytes` prompts wait for pages, and
a decode step that finds none preempts the sequence that arrived last (recomputed later from its prompt and the
tokens it produced). On CUDA the batch's decode forward is a CUDA graph captured once per bucket of rows and key
length and replayed (`DecodeSteps`, `--decode-step`). Under tensor parallelism every rank runs the engine
(`Replicas`). The HTTP side (requests in, replies out) is kimik3/serve.py."""

import asyncio
import contextlib
import hashlib
import importlib
import threading
import uuid
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch


class ServeError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely (0..MAX_TOP_LOGPROBS)


class Job:
    """One sequence being generated: its prompt, its cache while it prefills alone, what it has produced (ids and,
    with `logprobs`, each one's log-probability and the top ones), and the mailbox its HTTP handler reads (token ids
    as they come, then None). `twin`: the job of the same request whose prefill it shares (`n` > 1), and in the paged
    batch the prompt's full pages."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling, loop: asyncio.AbstractEventLoop, index: int = 0,
                 twin: "Job | None" = None):
        self.id = uuid.uuid4().hex[:12]
        self.prompt_ids, self.sampling, self.loop, self.index, self.twin = prompt_ids, sampling, loop, index, twin
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self.new_ids: list[int] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.cache = None
        self.prefilled = 0  # prompt tokens the cache holds
        self.cached_tokens = 0  # of them, taken from the prefix store
        self.last_logits = None  # after the prompt, for the twins
        self.cache_after_prompt = None
        self.finish_reason: str | None = None
        self.key = -1  # the engine's number for it (the same on every rank under tensor parallelism)
        self.cancel_asked = False  # by its HTTP side, at any time
        self.cancelled = False  # by the engine, at the start of a step
        self.decoded: TextSoFar | None = None  # the engine's, from the first token on
        self.images: dict | None = None  # the prompt's images (pixel_values, grid_thws): read in one forward
        self.images_read = False  # by a forward, or standing in a prefix the store gave back
        self.store_key: list[int] | None = None  # what the prefix store knows the prompt by (`Engine._store_key`)
        # after a prefix-store hit: (the stored cache it copied from, the tokens whose latents it took from there);
        # the row that holds that stored prompt's latents in its pages shares them when this job joins
        self.stored_prefix: tuple | None = None
        # the batch its prompt is read in, in lockstep with others (`Engine._read_lockstep`), until its prompt ends
        self.lockstep: "Lockstep | None" = None
        self.alone = False  # its lockstep's forward failed: it reads its prompt alone
        # pool pages set aside for its cache while it reads (under --max-cache-bytes); None until they are (0: a twin
        # whose prompt fills whole pages needs none of its own)
        self.pages: int | None = None
        # after a preemption: the prompt and the tokens produced but its last (whose latents the batch held); read
        # again like a prompt, then the job rejoins the batch and its last token is decoded
        self.resume_ids: list[int] | None = None
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed + index)

    @property
    def read_ids(self) -> list[int]:
        """What the job's cache must hold before it joins the batch: its prompt, or what a preemption took."""
        return self.prompt_ids if self.resume_ids is None else self.resume_ids

    def post(self, item) -> None:
        if self.loop is None:  # a job mirrored on another rank has no client
            return
        try:
            self.loop.call_soon_threadsafe(self.mailbox.put_nowait, item)
        except RuntimeError:  # its event loop is closed (the server is going down): nobody is left to read it
            pass

    def cancel(self) -> None:
        """The client went away or is done with it: the engine ends it at its next step."""
        self.cancel_asked = True

    def visible(self, ended: bool) -> str:
        """What the job generated that a client may see: `TextSoFar.visible`, or nothing before its first token."""
        return "" if self.decoded is None else self.decoded.visible(ended)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled


FINISH_REASONS = (None, "stop", "length")
FINISH_CODES = {reason: code for code, reason in enumerate(FINISH_REASONS)}


@dataclass
class Lockstep:
    """Prompts read in one batch, each row a prompt, every row at the same position (`Engine._read_lockstep`)."""

    jobs: list
    cache: object
    position: int = 0


class Replicas:
    """The engine's ranks under tensor parallelism, and what the leader (rank 0) tells the others, as tensors
    broadcast from it (no pickling): at each step's start the jobs that came (prompt, twin, `n` index, max_tokens,
    and a prompt's images: their grids, then their pixels) and the ones cancelled,
    or that the engine stops; after each forward, the token a job drew and how it ended."""

    def __init__(self, rank: int, wire: torch.device):
        self.rank, self.wire = rank, wire

    @classmethod
    def of(cls, device: torch.device) -> "Replicas | None":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        # NCCL moves CUDA tensors only; gloo CPU ones
        wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), wire)

    def _broadcast(self, values: list[int] | None) -> list[int]:
        import torch.distributed as dist

        length = torch.tensor([len(values) if values is not None else 0], dtype=torch.int64, device=self.wire)
        dist.broadcast(length, src=0)
        data = (torch.tensor(values, dtype=torch.int64, device=self.wire) if values is not None else
                torch.empty(int(length), dtype=torch.int64, device=self.wire))
        if int(length):
            dist.broadcast(data, src=0)
        return data.tolist()

    def _broadcast_pixels(self, pixels: torch.Tensor | None, shape: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        data = (pixels.to(self.wire, torch.float32).contiguous() if pixels is not None else
                torch.empty(shape, dtype=torch.float32, device=self.wire))
        dist.broadcast(data, src=0)
        return data.cpu()

    def send_step(self, came: list[Job], cancelled: list[Job], stop: bool) -> None:
        values = [int(stop), len(came), len(cancelled), *(job.key for job in cancelled)]
        for job in came:
            twin = job.twin.key if job.twin is not None else -1
            values += [job.key, twin, job.index, job.sampling.max_tokens, len(job.prompt_ids), *job.prompt_ids]
            if job.images is None:
                values.append(0)
            else:
                grids, pixels = job.images["grid_thws"], job.images["pixel_values"]
                values += [1, grids.shape[0], *grids.reshape(-1).tolist(), pixels.dim(), *pixels.shape]
        self._broadcast(values)
        for job in came:
            if job.images is not None:
                self._broadcast_pixels(job.images["pixel_values"], [])

    def receive_step(self) -> tuple[list[tuple], list[int], bool]:
        values = self._broadcast(None)
        stop, came, cancelled = values[:3]
        keys, at, specs = values[3:3 + cancelled], 3 + cancelled, []
        for _ in range(came):
            key, twin, index, max_tokens, length = values[at:at + 5]
            prompt, at = values[at + 5:at + 5 + length], at + 5 + length
            images = None
            if values[at]:
                count = values[at + 1]
                grids = torch.tensor(values[at + 2:at + 2 + 3 * count], dtype=torch.int64).reshape(count, 3)
                at += 2 + 3 * count
                shape, at = values[at + 1:at + 1 + values[at]], at + 1 + values[at]
                images = (grids, shape)
            else:
                at += 1
            specs.append((key, twin, index, max_tokens, prompt, images))
        for position, (*spec, images) in enumerate(specs):
            if images is not None:
                grids, shape = images
                specs[position] = (*spec, {"pixel_values": self._broadcast_pixels(None, shape), "grid_thws": grids})
        return specs, keys, bool(stop)

    def share(self, choice: tuple[int, int] | None) -> tuple[int, int]:
        token, code = self._broadcast(list(choice) if choice is not None else None)
        return token, code


DECODE_STEPS = ("auto", "plain", "fixed", "captured", "compiled")


def row_bucket(rows: int, slots: int) -> int:
    """The rows a fixed-shape decode step runs for `rows` real ones: the next power of two, at most the slots held."""
    return min(1 << (rows - 1).bit_length(), slots)


def page_bucket(pages: int) -> int:
    """The pages a row's keys span in a fixed-shape decode step whose longest row needs `pages`: that many up to 8,
    then the next of 4, 5, 6, 7 or 8 times a power of two (at most a quarter more keys than needed), so a row's
    growth crosses into a new bucket (a new capture) a few times per doubling."""
    if pages <= 8:
        return pages
    unit = 1 << (pages.bit_length() - 3)
    return -(-pages // unit) * unit


MAX_SPECULATIVE_TOKENS = 16


def prompt_lookup(ids: list[int], count: int, ngram: int = 3) -> list[int]:
    """Up to `count` proposed next tokens by prompt lookup: the latest earlier occurrence of the last n tokens of `ids`
    (n from `ngram` down to 1, the longest that occurs) and the tokens after it; [] where none occurs."""
    for n in range(min(ngram, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + count]
    return []


def speculative_draws(probs_at, proposal: list[int], generator: torch.Generator | None):
    """A sampling row's tokens in a speculative round, one at a time: position i's proposal is kept with probability
    p_i(proposal), p_i = `probs_at(i)` (the row's sampling distribution there, after temperature and top_p); the
    first one not kept is replaced by a draw from p_i without it (renormalised), and the round's tokens end there; if
    every proposal is kept, one more token is drawn from p_m (`probs_at` may give weights: top_p leaves them
    unnormalised, and each is taken relative to their sum). A proposal is a draft that puts all its probability on
    one token, so each token is distributed as a draw from p_i itself would be: the round changes how many forwards
    the tokens take, not their distribution (tests/test_serve.py checks the frequencies). `probs_at` is called only
    for the positions reached."""
    for position, proposed in enumerate(proposal):
        probs = probs_at(position)
        if float(torch.rand((), generator=generator)) * float(probs.sum()) < float(probs[proposed]):
            yield proposed
            continue
        rest = probs.clone()
        rest[proposed] = 0.0
        yield int(torch.multinomial(rest, 1, generator=generator))
        return
    yield int(torch.multinomial(probs_at(len(proposal)), 1, generator=generator))


def _decode_logits(model, ids: torch.Tensor, step) -> torch.Tensor:
    """The next-token logits of one decode forward of `ids` [rows, 1] on the fixed-shape step `step`."""
    return model(input_ids=ids, past_key_values=step, use_cache=True).logits[:, -1]


class DecodeSteps:
    """The batch's decode forward at fixed shapes (docs/design.md, Serving, Captured decode steps). The rows are
    padded to a bucket (`row_bucket`) and every row's keys to the longest row's pages' bucket (`page_bucket`), and
    the forward runs on the paged cache's `fixed_step` for that bucket: the same tensors at every step that falls in
    it. With `capture` (CUDA) a bucket's first step runs eagerly on a side stream (kernels autotune, libraries take
    their workspaces), its second is captured as a CUDA graph, and every later one replays it: one launch a step
    instead of the forward's hundreds. A capture that fails (an op that reads a value on the host) turns capturing
    off for the engine, by name in `capture_error` and a warning, and the steps run eagerly at the same shapes. With
    `compile` the step is torch.compile'd before it is captured (one compile a bucket, at its first step: seconds,
    while the engine waits), so the graphs replay fused kernels, as `generate()`'s decode loop does."""

    def __init__(self, model, paged, capture: bool, compile: bool = False):
        self.model, self.paged, self.capture = model, paged, capture
        self.call = _decode_logits
        if compile:
            code = importlib.import_module(f"{type(model).__module__.rpartition('.')[0]}.generate_kimi_k3")
            compiled = torch.compile(_decode_logits, fullgraph=True, dynamic=False)

            def call(model, ids, step):  # a bucket is a shape: each compiles once, past dynamo's default limit
                try:
                    with torch._dynamo.config.patch(code._recompile_limits(256, 1024)):
                        return compiled(model, ids, step)
                except torch._dynamo.exc.TorchDynamoException as error:  # it did not compile: eager steps from here
                    self.call, self.compile_error = _decode_logits, f"{type(error).__name__}: {error}"
                    warnings.warn(f"kimik3 serve: the decode step did not compile ({self.compile_error}); it is "
                                  "captured uncompiled", stacklevel=2)
                    return _decode_logits(model, ids, step)

            self.call = call
        self.buckets: dict[tuple[int, int], dict] = {}
        self.addresses: tuple[int, ...] = ()  # the paged cache's tensors the buckets' steps read
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every bucket's graph
        self.capture_error: str | None = None
        self.compile_error: str | None = None
        self.counts = {"decode_graphs": 0, "decode_graph_replays": 0, "decode_padding_rows": 0}

    def run(self, tokens: list[int]) -> torch.Tensor:
        """The logits [rows, vocab] of one decode step whose rows (the paged cache's, in order) take `tokens`; the
        paged cache holds the step's tokens after it."""
        paged = self.paged
        paged.reserve_pages(1)
        rows = len(tokens)
        shape = (row_bucket(rows, paged.slots_held()), page_bucket(max(map(len, paged.block_tables))))
        addresses = tuple(tensor.data_ptr() for tensor in paged.buffers())
        if addresses != self.addresses:  # a grown pool or more slots: every step made (and graph captured) reads
            self.buckets.clear()         # the tensors before them
            self.addresses = addresses
        bucket = self.buckets.get(shape)
        if bucket is None:
            step = paged.fixed_step(*shape)
            bucket = self.buckets[shape] = {
                "step": step, "graph": None, "warm": False, "logits": None,
                "ids": torch.zeros(shape[0], 1, dtype=torch.long, device=step.inputs.device),
                "host_ids": torch.zeros(shape[0], 1, dtype=torch.long, pin_memory=step.inputs.is_cuda)}
        bucket["host_ids"].zero_()
        bucket["host_ids"][:rows, 0] = torch.tensor(tokens)
        bucket["ids"].copy_(bucket["host_ids"], non_blocking=True)
        bucket["step"].load(paged.block_tables, [length + 1 for length in paged.lengths])
        with torch.cuda.device(bucket["ids"].device) if self.capture else contextlib.nullcontext():
            logits = self._forward(bucket)  # (graphs and streams are made on the current device)
        paged.advance(1)
        self.counts["decode_padding_rows"] += shape[0] - rows
        return logits[:rows]

    def _call(self, bucket: dict) -> torch.Tensor:
        return self.call(self.model, bucket["ids"], bucket["step"])

    def _forward(self, bucket: dict) -> torch.Tensor:
        if not self.capture:
            return self._call(bucket)
        if bucket["graph"] is not None:
            bucket["graph"].replay()
            self.counts["decode_graph_replays"] += 1
            return bucket["logits"]
        if not bucket["warm"]:  # as a capture needs: the shapes' first run outside it, on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._call(bucket)
            torch.cuda.current_stream().wait_stream(side)
            bucket["warm"] = True
            return logits
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                bucket["logits"] = self._call(bucket)
        except Exception as error:  # noqa: BLE001 - the step runs eagerly; the reason is kept and shown
            self.capture, self.capture_error = False, f"{type(error).__name__}: {error}"
            warnings.warn(f"kimik3 serve: the decode step could not be captured as a CUDA graph ({self.capture_error});"
                          " decode steps run eagerly at fixed shapes", stacklevel=2)
            return self._call(bucket)
        bucket["graph"] = graph
        self.counts["decode_graphs"] += 1
        graph.replay()
        self.counts["decode_graph_replays"] += 1
        return bucket["logits"]


class Engine:
    """The scheduler: one thread runs steps. A step gives every job still reading its prompt one chunk (alone, on
    its own cache: a long prompt never holds up the others' decode), then one batched decode forward for every job
    past its prompt, their rows in one paged cache (`KimiK3PagedCache`: MLA latents in pages of `block_size` tokens
    through a block table per row, KDA states and conv windows stacked per row). Jobs join the batch at the step
    after their prompt ends (their latents written into pages once; the `n` sequences of a request share the prompt's
    full pages) and leave at the step they finish or their client
    goes away (their pages freed, nothing copied for the others). With `max_cache_bytes` the pool is fixed: a prompt
    starts reading only when the pages its cache will take are free, and a decode step that finds too few free pages
    preempts the sequence that arrived last (`_make_room`). With a prefix store (`prefix_cache_bytes`), a prompt
    starts from the longest stored prefix at a 512-token block or a whole earlier prompt (KDA snapshots written
    during prefill), and every prompt is stored when read. Short prompts that start together are read in one padded
    forward (`_read_together`), long ones in lockstep (`_read_lockstep`). The decode forward (`decode_step`): "plain"
    (the rows as they are, eagerly), "fixed" (at a bucket's fixed shapes, eagerly), "captured" (fixed, replayed from
    CUDA graphs: `DecodeSteps`), "compiled" (captured, torch.compile'd first), "auto" (captured on one CUDA device
    with the routed experts on it, else plain)."""

    def __init__(self, model, tokenizer, max_requests: int = 16, prefill_chunk: int = 512,
                 max_context: int | None = None, prefix_cache_bytes: int | None = 1 << 30,
                 max_cache_bytes: int | None = None, block_size: int = 64, decode_step: str = "auto",
                 speculative_tokens: int = 0):
        # the model's own code (a folder loaded with trust_remote_code runs its copy): its cache and prefix store,
        # through the text model's module (a folder with a vision tower loads the multimodal one, which imports it)
        package = type(model).__module__.rpartition(".")[0]
        self.code = importlib.import_module(f"{package}.modeling_kimi_k3")
        self.cache_code = importlib.import_module(f"{package}.cache_kimi_k3")
        self.model, self.tokenizer = model, tokenizer
        self.text_config = model.config.get_text_config()
        self.max_requests, self.prefill_chunk = max_requests, prefill_chunk
        self.max_context = max_context or getattr(self.text_config, "max_position_embeddings", None) or 1 << 20
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.device = model.get_input_embeddings().weight.device
        self.media_id = getattr(model.config, "media_placeholder_token_id", None)  # an image's placeholder rows
        self.store = self.code.KimiK3PrefixStore(max_bytes=prefix_cache_bytes) if prefix_cache_bytes else None
        self.prefix_cache_bytes = prefix_cache_bytes
        self.max_cache_bytes = max_cache_bytes
        self.dtype_bytes = model.get_input_embeddings().weight.element_size()
        self.block_size = block_size
        self.paged = self.cache_code.KimiK3PagedCache(self.text_config, block_size=block_size,
                                                      num_pages=self._pool_pages(max_cache_bytes, max_requests),
                                                      max_rows=max_requests)
        self.queue: deque[Job] = deque()
        self.reading: list[Job] = []  # prefilling, alone (a preempted job again, first in line)
        self.batch: list[Job] = []  # the rows of `paged`, in order
        self.lockstep_groups: list[Lockstep] = []  # prompts being read in one batch (`_read_lockstep`)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False
        self.stats = {"steps": 0, "decode_forwards": 0, "rows_decoded": 0, "prefill_forwards": 0,
                      "prompt_tokens_computed": 0, "prompt_tokens_reused": 0, "regroups": 0, "preemptions": 0,
                      "tokens_recomputed": 0, "latent_bytes_copied": 0, "pages_held": 0, "pages_shared": 0,
                      "decode_graphs": 0, "decode_graph_replays": 0, "decode_padding_rows": 0,
                      "speculative_rounds": 0, "tokens_proposed": 0, "tokens_accepted": 0}
        # a stored prompt -> the job whose row holds its latents in pages (it read the prompt and joined with it), by
        # weak references both ways (gone with the store's entry or the job): a later prompt that starts from it
        # shares that row's full pages (`_regroup`)
        self.page_holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Under tensor parallelism (torchrun, a model loaded with a tp_plan) every rank runs this engine, since every
        # forward is a collective: rank 0 (the leader) takes the requests and samples, and at each step start tells
        # the other ranks which jobs came and which were cancelled, and after each forward the token each job drew
        # and whether it ended, so every rank runs the same forwards on the same caches (`Replicas`).
        self.replicas = Replicas.of(self.device)
        self.leader = self.replicas is None or self.replicas.rank == 0
        self.decode_step = self._decode_step(decode_step)
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or \
                not 0 <= speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens={speculative_tokens!r} (--speculative-tokens) must be a whole number "
                             f"from 0 (off) to {MAX_SPECULATIVE_TOKENS}")
        self.speculative_tokens = speculative_tokens
        self.steps = None if self.decode_step == "plain" else \
            DecodeSteps(model, self.paged, capture=self.decode_step in ("captured", "compiled"),
                        compile=self.decode_step == "compiled")
        self.by_key: dict[int, Job] = {}
        self.next_key = 0
        self.thread = threading.Thread(target=self._loop, name="kimik3-serve-engine", daemon=True)
        self.thread.start()

    def _decode_step(self, asked: str) -> str:
        """The decode forward `asked` for (`DECODE_STEPS`), "auto" resolved; a ValueError naming --decode-step where
        it cannot run here."""
        if asked not in DECODE_STEPS:
            raise ValueError(f"decode_step={asked!r} (--decode-step) must be one of {', '.join(DECODE_STEPS)}")
        # the host reads the routes of experts kept in host memory inside a forward: no graph holds that
        offloaded = getattr(self.model, "experts_cache", None) is not None
        capturable = self.device.type == "cuda" and self.replicas is None and not offloaded
        if asked in ("captured", "compiled") and not capturable:
            where = ("the model is not on a CUDA device" if self.device.type != "cuda" else "under tensor "
                     "parallelism" if self.replicas is not None else "with the routed experts in host memory")
            raise ValueError(f"decode_step={asked!r} (--decode-step {asked}): a CUDA graph cannot hold the decode "
                             f"step {where}; use fixed or plain")
        if asked == "auto":
            return "captured" if capturable else "plain"
        return asked

    def _pool_pages(self, max_cache_bytes: int | None, max_requests: int) -> int | None:
        """The pool's pages under a byte budget (None: no budget, a pool that grows): what the budget leaves after
        the KDA states and conv windows of `max_requests` sequences (fixed-size, one set a sequence), in pages of
        `block_size` tokens over every MLA layer, less the pool's zero page."""
        if max_cache_bytes is None:
            return None  # the pool checks the page size (cache_kimi_k3.check_block_size)
        size = self.block_size
        page = self.cache_code.paged_page_bytes(self.text_config, size, self.dtype_bytes)
        states = max_requests * self.cache_code.snapshot_bytes(self.text_config, dtype_bytes=self.dtype_bytes)
        if max_cache_bytes < states + 2 * page:
            raise ValueError(f"max_cache_bytes={max_cache_bytes:,} (--max-cache-bytes) holds no page: the KDA states "
                             f"of {max_requests} sequences (--max-requests) take {states:,} bytes, and a page of "
                             f"{size} tokens (--block-size) over the MLA layers {page:,} (one page, and the zero page "
                             f"that padding reads); give at least {states + 2 * page:,}")
        return (max_cache_bytes - states) // page - 1  # the pool's zero page counts too

    def pages_at_longest(self, job: Job) -> int:
        """The pages a job's row holds at its longest (prompt + max_tokens)."""
        return self.cache_code.pages_for(len(job.prompt_ids) + job.sampling.max_tokens, self.block_size)

    def submit(self, jobs: list[Job]) -> None:
        if self.stopped or not self.thread.is_alive():
            raise ServeError(503, "the server's engine is not running; restart the server", kind="server_error")
        pool = self.paged.num_pages
        longest = max(self.pages_at_longest(job) for job in jobs)
        if pool is not None and longest > pool:
            page = self.cache_code.paged_page_bytes(self.text_config, self.block_size, self.dtype_bytes)
            raise ServeError(400, f"a sequence of this request would hold {longest * page:,} bytes of MLA latents at "
                                  f"prompt + max_tokens ({longest} pages of {self.block_size} tokens), more than the "
                                  f"server's pool of {pool * page:,} ({pool} pages; --max-cache-bytes): lower "
                                  "max_tokens", "max_tokens")
        with self.lock:
            live = [*self.queue, *self.reading, *self.batch]
            busy = len(live)
            if busy + len(jobs) > self.max_requests:
                raise ServeError(429, f"the server is at capacity: {busy} sequences running or queued, "
                                      f"{len(jobs)} more asked, at most {self.max_requests} (--max-requests); retry "
                                      "later", kind="rate_limit_exceeded")
            for job in jobs:
                job.key, self.next_key = self.next_key, self.next_key + 1
            self.queue.extend(jobs)
        self.wake.set()

    def busy(self) -> int:
        with self.lock:
            return len(self.queue) + len(self.reading) + len(self.batch)

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._begin_step():
            if not self.reading and not self.batch:
                if self.leader:
                    self.wake.wait(0.05)
                    self.wake.clear()
                continue
            try:
                self._read_prompts()
                self._decode()
            except Exception as error:  # noqa: BLE001 - the batch's requests get it by name, the server goes on
                # the paged cache is in an unknown state after a failed forward or regroup: its rows end
                for job in self.batch:
                    self._fail(job, error)
                    job.post(None)
                    self._forget(job)
                self.batch = []
                self.paged.reset()
            self.stats["steps"] += 1
            self.stats["pages_held"] = self.paged.pages_held

    def _begin_step(self) -> bool:
        """The jobs that came and those whose clients cancelled them, taken in at a step's start (the leader's from its
        queue and flags, sent to the other ranks; theirs received); whether the engine stops."""
        if self.leader:
            with self.lock:
                came = list(self.queue)
                self.queue.clear()
                self.reading.extend(came)
            self.by_key.update((job.key, job) for job in came)
            cancelled = [job for job in (*self.reading, *self.batch) if job.cancel_asked and not job.cancelled]
            stop = self.stopped
            if self.replicas is not None:
                self.replicas.send_step(came, cancelled, stop)
        else:
            specs, keys, stop = self.replicas.receive_step()
            came = []
            for key, twin, index, max_tokens, prompt, images in specs:  # a twin comes after its source, in one step
                job = Job(prompt, Sampling(max_tokens=max_tokens), None, index, self.by_key.get(twin))
                job.key, job.images = key, images
                self.by_key[key] = job
                came.append(job)
            self.reading.extend(came)
            cancelled = [self.by_key[key] for key in keys if key in self.by_key]
        for job in cancelled:
            job.cancelled = True
        return stop

    def _forget(self, job: Job) -> None:
        self.by_key.pop(job.key, None)

    @staticmethod
    def _fail(job: Job, error: Exception) -> None:
        if not job.done:
            job.finish_reason = "error"
            job.post(ServeError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error"))

    @torch.no_grad()
    def _read_prompts(self) -> None:
        ready = []  # prompts read, or jobs that ended while reading (went away, failed, ended at their first token)
        self._set_pages_aside()
        together = self._read_together() | self._read_lockstep()
        for job in list(self.reading):
            if job.lockstep is not None:
                continue  # its batch read its chunk
            try:
                read = job in together or (not job.done and self._may_read(job) and self._read(job))
            except Exception as error:  # noqa: BLE001 - this request gets it by name, the others go on
                self._fail(job, error)
                read = False
            if read or job.done:
                ready.append(job)
        with self.lock:
            for job in ready:
                self.reading.remove(job)
        for job in ready:
            job.cache_after_prompt = None  # twins read in the same pass as their source, after it
            job.pages = None  # what it set aside its row takes now (or it ended)
            if job.done:
                job.cache = None
                job.post(None)
                self._forget(job)
        if any(not job.done for job in ready):
            self._regroup(add=[job for job in ready if not job.done])

    def _read(self, job: Job) -> bool:
        """One chunk of the job's prompt; whether the prompt is read (and its first token sampled)."""
        if job.twin is not None:
            source = job.twin
            if source.last_logits is None and not source.done:
                return False  # its source still reads the prompt
            if source.cache_after_prompt is None or (source.done and self.paged.num_pages is not None):
                # the source failed or went away before its prompt ended, or read it at a step this job could not
                # (no pages free then), or ended at its first token and does not join (under a fixed pool this job
                # set aside its partial page only): it reads the prompt itself, into pages of its own, set aside anew
                job.twin, job.pages = None, None
                return False
            job.cache = source.cache_after_prompt.copy_prefix(len(job.prompt_ids))
            job.prefilled, job.cached_tokens = len(job.prompt_ids), source.cached_tokens
            self._emit(job, source.last_logits)
            return True
        if job.cache is None:
            self._start(job)
        ids = job.read_ids
        end = min(len(ids), job.prefilled + self.prefill_chunk)
        extra = {}
        if job.images is not None and not job.images_read:
            # the images run in the prompt's first forward, which reaches past their placeholder rows
            end = max(end, self._image_runs(job)[-1][1])
            extra = {key: value.to(self.device) for key, value in job.images.items()}
            job.images_read = True
        chunk = torch.tensor([ids[job.prefilled:end]], device=self.device)
        out = self.model(input_ids=chunk, past_key_values=job.cache, use_cache=True, logits_to_keep=1, **extra)
        self.stats["tokens_recomputed" if job.resume_ids else "prompt_tokens_computed"] += end - job.prefilled
        self.stats["prefill_forwards"] += 1
        job.prefilled = end
        if end < len(ids):
            return False
        if job.resume_ids is not None:
            return True  # it rejoins the batch, which decodes its last token: nothing is sampled here
        job.last_logits = out.logits[0, -1].float()
        return self._prompt_read(job)

    def _read_together(self) -> set:
        """Prompts that fit in one chunk and start from nothing (no stored prefix, no images, not a twin), read
        several in one forward: left-padded to the longest of a group whose padded tokens fit in `prefill_chunk`
        (MLA has no positional encoding and the KDA layers skip the padding, so each row is its prompt alone), the
        batch's cache then split into one per prompt. A burst of short requests costs one forward a group instead of
        one a request. Each group's first tokens are sampled and posted as soon as its forward ends (`_prompt_read`),
        before the next group's runs: a burst's first requests see their first token after one group's forward, not
        after every group's. A group whose forward fails is read job by job (its own caches untouched), so only the
        prompt that fails ends its request; one whose first token fails (non-finite logits) ends alone. Returns the
        jobs read (their first token sampled, or ended by their error)."""
        fresh = self._fresh_prompts(short=True)
        groups, group = [], []
        for job in fresh:
            if group and (len(group) + 1) * max(len(j.prompt_ids) for j in (*group, job)) > self.prefill_chunk:
                groups.append(group)
                group = []
            group.append(job)
        groups.append(group)
        read = set()
        for group in (g for g in groups if len(g) > 1):
            try:
                self._read_group(group)
            except Exception:  # noqa: BLE001 - each is read alone then, so a prompt that fails ends its request alone
                continue
            for job in group:
                try:
                    self._prompt_read(job)
                except Exception as error:  # noqa: BLE001 - this request gets it by name, the others go on
                    self._fail(job, error)
            read.update(group)
        return read

    def _read_lockstep(self) -> set:
        """Prompts longer than the groups of `_read_together` take, starting from nothing at the same step (no stored
        prefix, no images, not a twin), read in lockstep: one batch, a row each, one forward a step over the next
        min(prefill_chunk, the shortest remainder) tokens of every row, so every row stays at the same position (no
        padding: each row's conv windows and KDA state are its prompt's alone, and the batch's snapshots fall at the
        store's block ends of every row). A row whose prompt ends is taken out into a cache of its own
        (`KimiK3Cache.select_rows`, its snapshots with it), stored and sampled; the others go on. Rows that went
        away or were preempted leave the batch. A forward that fails sends its rows back to read alone from the
        start, so only a prompt that fails there ends its request. Returns the jobs read."""
        started = self._fresh_prompts(short=False)
        if len(started) > 1:
            group = Lockstep(started, self._new_cache(len(started)))
            for job in started:
                job.cache, job.lockstep = None, group
            self.lockstep_groups.append(group)
        read = set()
        for group in list(self.lockstep_groups):
            read |= self._lockstep_step(group)
        return read

    def _fresh_prompts(self, short: bool) -> list[Job]:
        """The prompts that start from nothing at this step, started (`_start`; a stored prefix sends a job on alone):
        jobs not started yet (not a twin, no images, not resumed after a preemption, not sent to read alone), of at
        most the tokens a padded group reads (`short`: a chunk, and within the store's block, beyond which a prompt
        writes the KDA snapshot a later block hit needs) or more (not `short`)."""
        longest = self.prefill_chunk if self.store is None else min(self.prefill_chunk, self.store.block_size)
        fresh = []
        for job in self.reading:
            if job.done or job.cache is not None or job.twin is not None or job.images is not None or job.alone \
                    or job.resume_ids is not None or job.lockstep is not None or not self._may_read(job) \
                    or (len(job.prompt_ids) <= longest) != short:
                continue
            try:
                self._start(job)
            except Exception as error:  # noqa: BLE001 - this request gets it by name, the others go on
                self._fail(job, error)
                continue
            if job.prefilled == 0:
                fresh.append(job)
        return fresh

    def _new_cache(self, rows: int = 1):
        """A prompt's growing cache (with the store, KDA snapshots at its block ends, the store's bytes a row)."""
        if self.store is None:
            return self.code.KimiK3Cache(self.text_config)
        return self.code.KimiK3Cache(self.text_config, snapshot_interval=self.store.block_size,
                                     max_snapshot_bytes=self.prefix_cache_bytes * rows)

    def _lockstep_step(self, group: Lockstep) -> set:
        kept = [row for row, job in enumerate(group.jobs) if job.lockstep is group and not job.done]
        for job in group.jobs:
            if job.done:
                job.lockstep = None  # it went away: `_read_prompts` ends it
        if len(kept) < len(group.jobs):  # rows that went away or were preempted leave the batch
            group.cache = group.cache.select_rows(kept) if kept and group.position else group.cache
            group.jobs = [group.jobs[row] for row in kept]
        if not group.jobs:
            self.lockstep_groups.remove(group)
            return set()
        start = group.position
        tokens = min(self.prefill_chunk, min(len(job.read_ids) - start for job in group.jobs))
        ids = torch.tensor([job.read_ids[start:start + tokens] for job in group.jobs], device=self.device)
        try:
            out = self.model(input_ids=ids, past_key_values=group.cache, use_cache=True, logits_to_keep=1)
        except Exception:  # noqa: BLE001 - each reads alone from the start, so a prompt that fails ends alone
            self.lockstep_groups.remove(group)
            for job in group.jobs:
                job.lockstep, job.alone, job.prefilled = None, True, 0
            return set()
        self.stats["prompt_tokens_computed"] += ids.numel()
        self.stats["prefill_forwards"] += 1
        group.position = start + tokens
        ended = [row for row, job in enumerate(group.jobs) if len(job.read_ids) == group.position]
        read = set()
        for row in ended:
            job = group.jobs[row]
            job.cache, job.prefilled, job.lockstep = group.cache.select_rows([row]), group.position, None
            job.last_logits = out.logits[row, -1].float()
            try:
                self._prompt_read(job)
            except Exception as error:  # noqa: BLE001 - this request gets it by name, the others go on
                self._fail(job, error)
            read.add(job)
        going = [row for row in range(len(group.jobs)) if row not in ended]
        if ended and going:
            group.cache = group.cache.select_rows(going)
        group.jobs = [group.jobs[row] for row in going]
        for job in group.jobs:
            job.prefilled = group.position
        if not group.jobs:
            self.lockstep_groups.remove(group)
        return read

    def _read_group(self, group: list[Job]) -> None:
        longest = max(len(job.prompt_ids) for job in group)
        ids = torch.tensor([[0] * (longest - len(job.prompt_ids)) + job.prompt_ids for job in group],
                           device=self.device)
        mask = torch.tensor([[0] * (longest - len(job.prompt_ids)) + [1] * len(job.prompt_ids) for job in group],
                            device=self.device)
        cache = self.code.KimiK3Cache(self.text_config)
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.stats["prompt_tokens_computed"] += int(mask.sum())
        self.stats["prefill_forwards"] += 1
        for job, row, logits in zip(group, cache.split(mask.bool()), out.logits[:, -1].float()):
            job.cache, job.prefilled, job.last_logits = row, len(job.prompt_ids), logits

    def _prompt_read(self, job: Job) -> bool:
        """After a job's whole prompt is in its cache and `last_logits` hold its next token's: a copy for its twins
        and the store, then its first token."""
        # what the twins and the store copy from (the job's own cache goes on into the batch); none when neither
        # wants it
        if self.store is not None or any(other.twin is job for other in self.reading):
            job.cache_after_prompt = job.cache.copy_prefix(len(job.prompt_ids))
        if self.store is not None:
            self.store.insert(self._store_key(job), job.cache_after_prompt)
            self.page_holders[job.cache_after_prompt] = weakref.ref(job)
        self._emit(job, job.last_logits)
        return True

    def _store_key(self, job: Job) -> list[int]:
        """The ids the prefix store knows a prompt by: its own, except each image's placeholder rows, which become
        ids drawn from a hash of that image's pixels and grid (negative: no token has them). So a prompt matches a
        stored one through an image only if it holds the same image (an agent's later turns, the screenshot of the
        first one in them), and ids alone never stand for two pictures."""
        if job.images is None:
            return job.prompt_ids
        if job.store_key is None:
            pixels = job.images["pixel_values"].to("cpu", torch.float32).contiguous()
            grids = job.images["grid_thws"].to("cpu", torch.int64)
            digests = [int.from_bytes(hashlib.blake2b(part.numpy().tobytes() + grid.numpy().tobytes(),
                                                      digest_size=8).digest(), "little")
                       for part, grid in zip(pixels.split(grids.prod(-1).tolist()), grids)]
            key = list(job.prompt_ids)
            for (start, end), digest in zip(self._image_runs(job), digests):
                key[start:end] = [-1 - (digest + row) % (1 << 62) for row in range(end - start)]
            job.store_key = key
        return job.store_key

    def _image_runs(self, job: Job) -> list[tuple[int, int]]:
        """Where each image's placeholder rows are in the prompt: (start, end), in the images' order."""
        runs = []
        for position, token in enumerate(job.prompt_ids):
            if token == self.media_id:
                if runs and runs[-1][1] == position:
                    runs[-1][1] += 1
                else:
                    runs.append([position, position + 1])
        return [tuple(run) for run in runs]

    def _holds_images(self, job: Job, tokens: int, cache) -> bool:
        """Whether a stored prefix of `tokens` (its KDA state restored `cache.pending_tokens` before its end) can
        start a prompt with images: only if its restored state is past every image's rows (the model reads images
        in a prompt's first forward only, and a replay cannot run rows without their pixels)."""
        restored = tokens - cache.pending_tokens
        return all(end <= restored for _, end in self._image_runs(job))

    def _start(self, job: Job) -> None:
        if self.store is not None:
            key = self._store_key(job)
            if job.resume_ids is not None:  # the prompt (stored when first read) and the tokens it produced
                key = key + job.resume_ids[len(job.prompt_ids):]
            tokens, cache, stored = self.store.lookup(key, with_source=True)
            if cache is not None and job.images is not None:
                if self._holds_images(job, tokens, cache):
                    job.images_read = True  # the images stand in the stored state
                else:
                    cache = None  # the images would have to run on a cache that holds tokens: read the prompt whole
            if cache is not None:
                # the cache stands for `tokens`; those after its nearest KDA snapshot run with the first chunk (and
                # write latents of their own: only those before them are the stored prompt's)
                job.cache, job.prefilled = cache, tokens
                job.stored_prefix = (stored, tokens - cache.pending_tokens)
                self.stats["prompt_tokens_reused"] += tokens - cache.pending_tokens
                if job.resume_ids is not None:
                    self.stats["tokens_recomputed"] += cache.pending_tokens
                    return  # its usage keeps what its first read reused
                job.cached_tokens = tokens - cache.pending_tokens
                self.stats["prompt_tokens_computed"] += cache.pending_tokens
                return
            job.cache = self._new_cache()  # KDA snapshots at the store's block ends: a hit at any block restores there
        else:
            job.cache = self._new_cache()

    def _regroup(self, add: list[Job] = ()) -> None:
        """The batch's rows after jobs left (done: their pages freed) or came (`add`, their caches holding what they
        read: written into pages once)."""
        gone = [row for row, job in enumerate(self.batch) if job.done]
        for job in self.batch:
            if job.done:
                job.post(None)  # its stream ends; its row is gone
                self._forget(job)
        # the batch first: if adding rows fails, the loop ends these jobs by name (none is left waiting)
        self.batch = [job for job in self.batch if not job.done] + list(add)
        self.paged.remove_rows(gone)
        copied = self.paged.latent_bytes_copied
        caches = [job.cache for job in add]
        # a twin joins beside its source (read in the same pass, `_read`): it holds the source's full prompt pages
        twins = [add.index(job.twin) if job.twin in add[:position] else None for position, job in enumerate(add)]
        shared = [None if twin is not None else self._shared_pages(job) for job, twin in zip(add, twins)]
        for job in add:
            job.cache, job.resume_ids, job.stored_prefix = None, None, None
        self.paged.add_rows(caches, twins, shared)
        self.stats["pages_shared"] += sum(entry[1] for entry in shared if entry is not None)
        self.stats["latent_bytes_copied"] += self.paged.latent_bytes_copied - copied
        self.stats["regroups"] += 1

    def _shared_pages(self, job: Job) -> tuple[int, int] | None:
        """(row, pages) for `KimiK3PagedCache.add_rows(shared=)`: where the job's prompt started from a stored prompt
        whose latents a row of the batch holds in its pages (the job that read it and joined with it, still there),
        the full pages of the tokens it took from there; None otherwise."""
        if job.stored_prefix is None:
            return None
        stored, tokens = job.stored_prefix
        holder = self.page_holders.get(stored, lambda: None)()
        if holder is None or holder.done or holder not in self.batch[:len(self.paged.lengths)]:
            return None
        row = self.batch.index(holder)
        pages = min(tokens, self.paged.lengths[row]) // self.block_size
        return (row, pages) if pages else None

    # ------------------------------------------------------------------------------------------------------------
    # The pool under --max-cache-bytes: pages set aside for prompts being read, preemption when a step finds none
    def _may_read(self, job: Job) -> bool:
        return self.paged.num_pages is None or job.pages is not None

    def _pages_aside(self) -> int:
        return sum(job.pages for job in self.reading if job.pages and not job.done)

    def _set_pages_aside(self) -> None:
        """Jobs that have not started reading start, in line (a preempted job first, then by arrival), while the
        pages their caches will take when they join are free beside those set aside for the others and those the
        batch's next step takes; the first that does not fit waits, and those after it with it (a long prompt is not
        passed over for ever)."""
        if self.paged.num_pages is None:
            return
        # the batch's next step keeps its pages: a prompt that took them would be the first preempted
        free = self.paged.free_pages - self._pages_aside() - self.paged.pages_needed(1)
        for job in self.reading:
            if job.done or job.pages is not None:
                continue
            # a twin will hold its source's full pages (`_regroup`)
            wanted = self.cache_code.own_pages(len(job.read_ids), self.block_size, job.twin is not None)
            if wanted > free:
                return
            job.pages, free = wanted, free - wanted

    def _make_room(self) -> None:
        """Before a decode step under a fixed pool: while the batch's next tokens need more pages than are free
        beside those set aside, the sequence that arrived last among those holding pages or having pages set aside
        gives them up (`_preempt`). The one that arrived first is never preempted while another holds pages, and
        fits alone (`submit` refuses a sequence the pool could never hold), so every sequence ends."""
        if self.paged.num_pages is None:
            return
        while self.batch and self.paged.pages_needed(1) > self.paged.free_pages - self._pages_aside():
            holders = [*self.batch, *(job for job in self.reading if job.pages and not job.done)]
            self._preempt(max(holders, key=lambda job: job.key))

    def _preempt(self, job: Job) -> None:
        """The job's pages (or those set aside for it) go back to the pool. A job in the batch is read again from its
        prompt and the tokens it produced (from the prefix store's longest match, which holds its prompt), then
        rejoins and goes on: its client sees the tokens it would have seen."""
        for stored in [stored for stored, holder in self.page_holders.items() if holder() is job]:
            del self.page_holders[stored]  # it is read again: its next pages hold what that read gives
        if job in self.batch:
            row = self.batch.index(job)
            self.paged.remove_rows([row])
            self.batch.pop(row)
            job.resume_ids = job.prompt_ids + job.new_ids[:-1]
            with self.lock:
                self.reading.insert(0, job)
        job.cache, job.prefilled, job.pages, job.twin, job.images_read = None, 0, None, None, False
        job.stored_prefix, job.lockstep = None, None
        self.stats["preemptions"] += 1

    @torch.no_grad()
    def _decode(self) -> None:
        if any(job.done for job in self.batch):
            self._regroup()
        self._make_room()
        if not self.batch or self._speculate():
            return
        if self.steps is not None:
            logits = self.steps.run([job.new_ids[-1] for job in self.batch])
            self.stats.update(self.steps.counts)
        else:
            ids = torch.tensor([[job.new_ids[-1]] for job in self.batch], device=self.device)
            mask = self.paged.attention_mask(1).to(self.device)
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=self.paged, use_cache=True)
            logits = out.logits[:, -1]
        self.stats["decode_forwards"] += 1
        self.stats["rows_decoded"] += len(self.batch)
        self._emit_rows(self.batch, logits)

    @torch.no_grad()
    def _speculate(self) -> bool:
        """A speculative round in place of the decode step (`speculative_tokens`): each row's next tokens proposed by
        prompt lookup over its prompt and its tokens so far, one forward verifying them all (the rows' last tokens and
        proposals, padded to the longest with tokens that are only rejected), a greedy row taking the model's greedy
        tokens while they agree with its proposals and one past them, a sampling row its `speculative_draws` (each
        proposal kept with its probability), and the paged cache keeping each row's own (`keep_verified`). Whether it
        ran: not under tensor parallelism, where no row has a proposal, or where the pool lacks the pages the round
        would take."""
        if not self.speculative_tokens or self.replicas is not None:
            return False
        proposals = [prompt_lookup(job.prompt_ids + job.new_ids, self.speculative_tokens) for job in self.batch]
        width = 1 + max(map(len, proposals))
        if width == 1 or (self.paged.num_pages is not None and
                          self.paged.pages_needed(width) > self.paged.free_pages - self._pages_aside()):
            return False
        ids = torch.tensor([[job.new_ids[-1], *proposal, *[job.new_ids[-1]] * (width - 1 - len(proposal))]
                            for job, proposal in zip(self.batch, proposals)], device=self.device)
        self.paged.begin_verify()
        out = self.model(input_ids=ids, attention_mask=self.paged.attention_mask(width).to(self.device),
                         past_key_values=self.paged, use_cache=True)
        logits = out.logits.float()
        finite, greedy = torch.stack([torch.isfinite(logits).all(-1).long(), logits.argmax(-1)]).tolist()
        kept = []
        for row, (job, proposal) in enumerate(zip(self.batch, proposals)):
            emitted = 0
            sampled = job.sampling.temperature != 0
            draws = speculative_draws(lambda i, row=row, job=job: self._probs(logits[row, i], job), proposal,
                                      job.generator) if sampled else None
            while emitted < width and not job.done:
                is_finite = bool(finite[row][emitted])
                # a sampling row draws only from finite logits (else `_emit` ends it by name)
                token = next(draws) if sampled and is_finite else greedy[row][emitted]
                try:
                    self._emit(job, logits[row, emitted], (is_finite, token), chosen=sampled)
                except FloatingPointError as error:  # this row alone ends (`_emit_rows`)
                    self._fail(job, error)
                    break
                emitted += 1
                if emitted > len(proposal) or token != proposal[emitted - 1]:
                    break
            kept.append(max(emitted, 1))
            self.stats["tokens_proposed"] += len(proposal)
            self.stats["tokens_accepted"] += max(emitted - 1, 0)
        self.paged.keep_verified(kept)
        self.stats["speculative_rounds"] += 1
        self.stats["decode_forwards"] += 1
        self.stats["rows_decoded"] += len(self.batch)
        return True

    def _emit_rows(self, jobs: list[Job], logits: torch.Tensor) -> None:
        """`_emit` for each job still running, from its row of `logits` [rows, vocab]: whether each row is finite and
        its greedy token are read in one host read for the batch, and the rows that sample or report logprobs (which
        read the whole row) cross to the host together, instead of a read or two a row. A row whose logits are not
        all finite ends its own request (HTTP 500, by name); the rows are independent, so the others go on."""
        rows = logits.float()
        finite, greedy = torch.stack([torch.isfinite(rows).all(-1).long(), rows.argmax(-1)]).tolist()
        whole = [row for row, job in enumerate(jobs) if job.sampling.temperature != 0 or
                 job.sampling.logprobs is not None]
        on_host = dict(zip(whole, rows[whole].cpu())) if whole else {}
        for row, job in enumerate(jobs):
            if job.done:
                continue
            try:
                self._emit(job, on_host.get(row, rows[row]), (bool(finite[row]), greedy[row]))
            except FloatingPointError as error:  # this row's logits alone: its request ends by name, the others go on
                self._fail(job, error)

    def _emit(self, job: Job, logits: torch.Tensor, read: tuple[bool, int] | None = None,
              chosen: bool = False) -> None:
        """Samples the job's next token from `logits` (f32), posts it, and decides whether the job ends here: the
        leader does, and tells the other ranks (`Replicas.share`), whose copy of the job takes the same token and
        end. `read`: whether the logits are finite and their greedy token, where the caller read them already; with
        `chosen`, `read`'s token is the caller's choice for a sampling row too (a speculative round's draw)."""
        failed = None
        if self.leader:
            try:
                finite = self._choose(job, logits, read, chosen)
            except Exception as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised here
                if self.replicas is None:
                    raise
                failed, finite = error, False
        if self.replicas is not None:
            token, code = self.replicas.share(None if not self.leader else
                                              (-2 if failed else job.new_ids[-1] if finite else -1,
                                               FINISH_CODES[job.finish_reason]))
            if failed is not None:
                raise failed
            if token == -2:  # the leader's choice raised; it ends the job (or the batch) there too
                raise RuntimeError("rank 0 could not choose the next token (its error is in rank 0's response)")
            if not self.leader and token >= 0:
                job.new_ids.append(token)
                job.finish_reason = FINISH_REASONS[code]
            finite = token >= 0
        if not finite:  # never a token picked from NaN: the request ends by name
            raise FloatingPointError(f"the model's logits hold non-finite values after {len(job.new_ids)} tokens")

    def _choose(self, job: Job, logits: torch.Tensor, read: tuple[bool, int] | None = None,
                chosen: bool = False) -> bool:
        """`_emit`'s choice on the leader; False (nothing chosen) for logits that are not all finite."""
        finite, greedy = read if read is not None else (bool(torch.isfinite(logits).all()), None)
        if not finite:
            return False
        token = greedy if greedy is not None and (chosen or job.sampling.temperature == 0) else \
            self._sample(logits, job)
        job.new_ids.append(token)
        if job.sampling.logprobs is not None:
            logprobs = torch.log_softmax(logits.cpu(), dim=-1)
            top = torch.topk(logprobs, job.sampling.logprobs) if job.sampling.logprobs else None
            job.logprobs.append((float(logprobs[token]), [] if top is None else
                                 list(zip(top.indices.tolist(), top.values.tolist()))))
        if job.decoded is None and self.tokenizer is not None:  # (an engine driven without one only counts tokens)
            job.decoded = TextSoFar(self.tokenizer, job.sampling.stop)
        if job.decoded is not None:
            job.decoded.add(token)
        job.post(token)
        if token in self.eos:
            job.finish_reason = "stop"
        elif len(job.new_ids) >= job.sampling.max_tokens:
            job.finish_reason = "length"
        elif job.decoded is not None and job.decoded.state[1] is not None:  # a stop sequence
            job.finish_reason = "stop"
        return True

    @staticmethod
    def _probs(logits: torch.Tensor, job: Job) -> torch.Tensor:
        """The job's sampling distribution over the vocabulary (on the host): temperature, then top_p (unnormalised
        after top_p: `torch.multinomial` takes weights)."""
        sampling = job.sampling
        probs = torch.softmax(logits.cpu() / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            keep = ordered.cumsum(-1) - ordered < sampling.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return probs

    @staticmethod
    def _sample(logits: torch.Tensor, job: Job) -> int:
        if job.sampling.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(Engine._probs(logits, job), 1, generator=job.generator))


def stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop sequence begins in `text`, or None."""
    found = [text.index(stop) for stop in stops if stop in text]
    return min(found) if found else None


class TextSoFar:
    """A job's generated text, decoded as its tokens come, and where its first stop sequence begins. Each token is
    decoded with the few before it that do not end on a whole character (a byte-level token can end inside one), and
    the stop sequences are looked for only in what is new (and the stop's length before it), so a token costs the
    same at the end of a long reply as at its start; `state[0]` equals decoding all the ids at once. `state` is one
    (text, stop) pair, assigned whole: the HTTP side reads it while the engine's thread adds tokens."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.longest = max((len(stop) for stop in self.stops), default=0)
        self.state: tuple[str, int | None] = ("", None)
        self._settled, self._pending = "", []  # text of whole characters; ids after it

    def add(self, token: int) -> None:
        self._pending.append(token)
        window = self.tokenizer.decode(self._pending)
        text, stop = self._settled + window, self.state[1]
        if stop is None and self.stops:
            # the settled text was searched up to its end; a stop may straddle that end
            start = max(0, len(self._settled) - self.longest + 1)
            found = stop_at(text[start:], self.stops)
            stop = None if found is None else start + found
        if not window.endswith("\ufffd"):
            self._settled, self._pending = text, []
        self.state = (text, stop)

    def visible(self, ended: bool) -> str:
        """The text up to its first stop sequence; while the job runs, less what may yet change: a character whose
        bytes have not all come (decoded as U+FFFD for now) and an end that may become a stop sequence. It only ever
        grows, so a stream sends each character once."""
        text, stop = self.state
        if stop is not None:
            return text[:stop]
        if ended:
            return text
        text = text.rstrip("\ufffd")
        for held in range(min(self.longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-held:]) for s in self.stops):
                return text[:-held]
        return text


# ----------------------------------------------------------------------------------------------------------------
# Requests: parsed and checked by name before anything is queued
