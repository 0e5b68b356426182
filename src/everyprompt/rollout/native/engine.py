"""The native rollout engine: continuous batching over a preallocated KV cache, on the policy's weights.

A second implementation of the model's forward pass, written for decoding rather than gradients (as vLLM
is beside Megatron in production): no autograd, no module tree, one preallocated cache. Families:
`families.FAMILIES` (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3; attention
variants in attention.py, the MoE layer in moe.py); a config setting it does not compute is refused when
the model loads (`check_config`). Tested against the trainer's HF forward (log-probs within 1e-4 in fp32).

Layout: the cache has `batch_size` rows (slots). A request is admitted into a free row, its prompt
prefilled at cache positions [0, len) (prompts admitted together are right-padded; causal attention keeps
real tokens from seeing the padding), and its t-th generated token is fed at position len + t. A decode
step runs every row at once, each at its own position, attending to its positions <= that one. When a
sequence finishes, its row is refilled from the queue before the next step; once the queue is empty,
the running rows move to the front and the pool shrinks to them. A multi-turn request (its `episode`)
stays in its row across turns: at a turn's end its environment answers in a thread of its own while the
other rows decode (sequences.py), and the observation continues the same sequence in one forward from
the row's length (extend.py). The loop itself, and how it sends a step's forward ahead of reading the step's
tokens on a GPU: decode_loop.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from everyprompt.choices import GRAPH_BUCKETS, NATIVE_ENGINE, check_buckets, decoding
from everyprompt.models.lora import merged_state_dict
from everyprompt.rollout.base import Completion, GenerationRequest, SamplingParams
from everyprompt.rollout.native.attention import ATTENTIONS, decode_bias, rms_norm
from everyprompt.rollout.native.cache import KVCache
from everyprompt.rollout.native.compiled import DecodeCompiler
from everyprompt.rollout.native.decode_loop import DecodeCall
from everyprompt.rollout.native.families import FAMILIES, check_family
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.moe import MixtureOfExperts, swiglu
from everyprompt.rollout.native.plain_step import PlainStep
from everyprompt.rollout.native.queue import LiveRequests, Queue
from everyprompt.rollout.native.site import Site
from everyprompt.rollout.native.static_step import StaticStep, StepBuffers
from everyprompt.rollout.native.step import DecodeStep, StepModel
from everyprompt.rollout.native.weights import Layer, StateDict, copy_into, fp8_matmuls, read_layer
from everyprompt.rollout.registry import register_engine
from everyprompt.rollout.sampling import sampler
from everyprompt.rollout.stops import stop_token_ids

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


@register_engine(NATIVE_ENGINE, model_types=tuple(FAMILIES), rank=0)
class NativeEngine:
    """RolloutEngine over a state dict of one of `FAMILIES`. Build it with :meth:`from_model`."""

    PRECISIONS = tuple(PRECISIONS)
    # `device`: weights, cache and state there; `compile`: the decode step through torch.compile; `cuda_graphs`:
    # the static step captured (graphs.py); `episodes`: multi-turn requests (sequences.py); `decode_state`:
    # the compile switch through a checkpoint (compiled.py); `live`: requests that join a running call (queue.py)
    offers = frozenset(
        {"device", "compile", "cuda_graphs", "episodes", "decode_state", "weight_dtypes", "live"}
    )

    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        eos_token_id: int | Iterable[int],
        pad_token_id: int,
        batch_size: int = 256,
        *,
        dtype: torch.dtype = torch.float32,
        precision: str | None = None,
        tokenizer=None,
        compile: str = "off",
        device: torch.device | str = "cpu",
        fp8_matmul: bool | None = None,
        cuda_graphs: str = "auto",
        graph_buckets=GRAPH_BUCKETS,
    ):
        """`precision` (fp32 | bf16 | fp8) overrides `dtype`; fp8 keeps the attention and expert / MLP
        projections in float8_e4m3fn (per-output-channel scales, re-quantised by every `load_weights`),
        and embeddings, norms, routers and the LM head in float32. `compile` (off | on | auto): the
        decode step eager or through torch.compile (compiled.py). `device`: where the weights, the cache
        and every per-call tensor live (a resolved device, devices/placement.py). `fp8_matmul`: fp8
        projections multiplied in FP8 (`FP8Weight.matmul`) rather than dequantised; None: where the
        device has FP8 matmuls (weights.fp8_matmuls). `cuda_graphs` (auto | on | off | static) with
        `compile` and the device decide how the engine decodes (choices.decoding: `self.decoding`);
        `graph_buckets` (increasing batch sizes): the rows the static decode step (static_step.py) is captured
        at."""
        if precision is not None:
            if precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
            dtype = PRECISIONS[precision]
        self.precision = precision or ("bf16" if dtype == torch.bfloat16 else "fp32")
        self.check_config(config)
        self.config, self.family = config, FAMILIES[config.model_type]
        self.device = torch.device(device)
        fp8_matmul = fp8_matmul if self.precision == "fp8" else False
        self.fp8_matmul = fp8_matmuls(self.device) if fp8_matmul is None else fp8_matmul
        # the precision a decode step computes in (a graph's replay is judged at it: trust.py): bf16, or
        # fp8's products (their outputs are bf16), else float32
        self.step_precision = torch.bfloat16 if dtype == torch.bfloat16 or self.fp8_matmul else torch.float32
        self.stop_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.pad_token_id, self.tokenizer = pad_token_id, tokenizer
        self.batch_size, self.dtype = batch_size, dtype
        self.eps = config.rms_norm_eps
        self.attention = ATTENTIONS[self.family.attention](config, self.family, dtype)
        self.cache = KVCache(self.attention.cache_layout, config.num_hidden_layers, dtype, self.device)
        self.moe = MixtureOfExperts(config, self.family)
        try:
            self.decoding = decoding(compile, cuda_graphs, self.device.type)
        except ValueError as err:
            raise ValueError(f"{err} (the engine's device: {self.device})") from None
        self.static = self.decoding.static
        # the static step's compile: from the first call or never, and given up (with a warning) if it fails
        self.compiler = DecodeCompiler(self.decoding.compile, give_up=True if self.static else None)
        self.sampler = sampler(config.vocab_size, self.device)  # eager and compiled alike
        try:
            buckets = tuple(b for b in check_buckets(graph_buckets) if b < batch_size) + (batch_size,)
        except ValueError as err:
            raise ValueError(f"graph_buckets {list(graph_buckets)}: {err}") from None
        # graphs where real CUDA runs (a fake CUDA device runs the static step eagerly)
        capture = self.decoding.graphs and torch.cuda.is_available()
        self.graphs = StepGraphs(buckets, capture=capture, device=self.device)
        self._static: StaticStep | None = None
        self._decode_layers: list[Layer] | None = None  # fp8's dequantised layers, kept for the static step
        self._open_calls = 0  # generate() iterators not yet finished (the shared cache serves one)
        self.stats: dict[str, float] = {}  # the last generate call's throughput figures
        self.embed = self.final_norm = self.lm_head = self.layers = None
        self.load_weights(state_dict)
        # a mixture-of-experts model: its routers' choices can be recorded (kept while the engine sleeps)
        self.can_record_routes = any(layer.router is not None for layer in self.layers)

    @classmethod
    def check_config(cls, config) -> None:
        """UnsupportedModelError naming every setting of `config` this engine does not compute."""
        check_family(config)

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer,
        batch_size: int = 256,
        precision: str = "fp32",
        *,
        compile: str = "off",
        device: torch.device | str = "cpu",
        fp8_matmul: bool | None = None,
        cuda_graphs: str = "auto",
        graph_buckets=GRAPH_BUCKETS,
    ) -> NativeEngine:
        return cls(
            model.config,
            merged_state_dict(model),  # a LoRA policy's adapters folded in: the engine knows none
            stop_token_ids(model, tokenizer),
            tokenizer.pad_token_id,
            batch_size,
            precision=precision,
            tokenizer=tokenizer,
            compile=compile,
            device=device,
            fp8_matmul=fp8_matmul,
            cuda_graphs=cuda_graphs,
            graph_buckets=graph_buckets,
        )

    # ---------------------------------------------------------------- weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take `state_dict` (the trainer's names and layout) as the engine's weights; wakes a sleeping
        engine. Weights of the shapes already held are copied into their storage (same addresses, so
        captured graphs stay valid) one layer at a time, so that a sync needs one layer's new tensors
        beside the held weights, not a second copy of them all; unless a generate call is still open (it
        keeps decoding with the weights it started with): then, or where the shapes differ, they replace
        the held weights."""
        weights = StateDict(state_dict, self.dtype, fp8=self.precision == "fp8", device=self.device)
        if self.layers is None or self._open_calls or not self._copy_in(weights):
            self.embed, self.final_norm, self.lm_head = self._ends(weights)
            self.layers = [self._layer(weights, i) for i in range(self.config.num_hidden_layers)]
            self._decode_layers = None
        self._kept_dtypes = weights.kept

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each weight is held in where that is a plain cast of the weight as sent (fp8's
        quantised projections are not), so a sender may cast them first (rollout/base.py)."""
        return {name: dtype for name, dtype in self._kept_dtypes.items() if dtype is not None}

    def _ends(self, weights: StateDict) -> tuple:
        """The embedding, the final norm and the head (the embedding again where they are tied)."""
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        return (
            weights.plain("model.embed_tokens.weight"),
            weights.plain("model.norm.weight"),
            weights.operand(head),
        )

    def _layer(self, weights: StateDict, index: int) -> Layer:
        return self._prepared(read_layer(weights, self.family, self.attention, index))

    def _copy_in(self, weights: StateDict) -> bool:
        """`weights` copied into the held storage, layer by layer (fp8's decode copies too); False where a
        shape differs (a layer before it may have been copied: the caller replaces them all)."""
        if not copy_into((self.embed, self.final_norm, self.lm_head), self._ends(weights)):
            return False
        for index, held in enumerate(self.layers):
            if not copy_into(held, self._layer(weights, index)):
                return False
            if self._decode_layers is not None:
                copy_into(self._decode_layers[index], self._dequantized([held])[0])
        return True

    def decode_state(self) -> dict:  # the compile switch, for a checkpoint (base.py, compiled.py)
        return {"compile": self.compiler.state_dict()}

    def load_decode_state(self, state: dict) -> None:
        self.compiler.load_state_dict(state["compile"])

    def sleep(self) -> None:
        """Drop the weights, the KV cache's storage and the static step's buffers until the next
        `load_weights` (base.py); captured graphs go with them."""
        if self._open_calls:
            raise RuntimeError("sleep() while a generate call's iterator is still open")
        self.embed = self.final_norm = self.lm_head = self.layers = None
        self._decode_layers = self._static = None
        self.graphs.reset()
        self.cache.release()

    def _prepared(self, layer: Layer) -> Layer:
        """`layer` with what its attention derives from its weights for decoding made now (attention.py)."""
        self.attention.prepare(layer.attention)
        return layer

    def _dequantized(self, layers: list[Layer]) -> list[Layer]:
        return [self._prepared(layer.dequantized(keep_matmuls=self.fp8_matmul)) for layer in layers]

    def call_layers(self, static: bool) -> list[Layer]:
        """The layers a generate call decodes with: the weights themselves, or fp8's dequantised copies,
        made per call, or once per weight load for the static step (its graphs read their addresses)."""
        if not any(layer.quantized for layer in self.layers):
            return self.layers
        if not static:
            return self._dequantized(self.layers)
        if self._decode_layers is None:
            self._decode_layers = self._dequantized(self.layers)
        return self._decode_layers

    # ---------------------------------------------------------------- forward
    def _mlp(self, layer: Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        if layer.router is not None:
            return self.moe(layer, x, routes)
        return swiglu(layer.mlp, x)

    def forward(
        self, layers, tokens, positions, caches, site: Site, *, last=None, routes: list | None = None
    ) -> torch.Tensor:
        """Logits [B, V] at position `last` [B] of each row, the last position if None, of `tokens` [B, T] at
        `positions` [B, T] written where `site` says (attention.py: a prefill, an extend or a decode step),
        through `layers` (the call's dequantised `self.layers`).

        With `routes` (a list), appends each MoE layer's (expert indices [B, T, k], router logits [B, T, E]).
        """
        x = self.embed[tokens]
        rope = self.attention.rotary(positions)
        for layer, cache in zip(layers, caches):
            normed = rms_norm(x, layer.input_norm, self.eps)
            x = x + self.attention(layer.attention, normed, rope, cache, site)
            x = x + self._mlp(layer, rms_norm(x, layer.post_norm, self.eps), routes)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
        return (rms_norm(x, self.final_norm, self.eps) @ self.lm_head).float()

    # ---------------------------------------------------------------- decoding
    def generate(
        self, requests: Iterable[GenerationRequest] | LiveRequests, params: SamplingParams
    ) -> Iterator[Completion]:
        """Continuous batching: up to `batch_size` sequences decode together in cache slots; a finished
        sequence's slot is refilled from the queue (in the order given) before the next decode step.
        Each completion is yielded the moment it finishes. `self.stats` holds the call's throughput
        figures once the iterator is exhausted. A call made while another call's iterator is still open
        gets a cache of its own, so interleaved iterators do not corrupt each other. `requests` may be
        a `LiveRequests` (queue.py): requests that arrive while the call runs, until it is closed."""
        if self.layers is None:
            raise RuntimeError("the engine sleeps (its weights were dropped): load_weights() first")
        source = requests if isinstance(requests, LiveRequests) else Queue(list(requests))
        self.stats = {}
        if not (source.requests or source.live):
            return
        self._open_calls += 1
        try:
            yield from self._generate(source, params, shared=self._open_calls == 1)
        finally:
            self._open_calls -= 1

    @torch.inference_mode()
    def _generate(self, source: Queue | LiveRequests, params: SamplingParams, shared: bool):
        call = DecodeCall(self, source, params, self._stepper(shared), shared)  # the loop: decode_loop.py
        yield from call
        self.stats = call.stats()

    def _stepper(self, shared: bool) -> DecodeStep:
        """How this call decodes (`self.decoding`): the static step (on the engine's shared cache), else the
        plain step; either compiled where `compile` says so (auto: the plain step, once eager decoding has
        cost enough). The static step keeps the model it was made with: its graphs captured those bodies."""
        compiled = self.compiler.active
        if compiled and not self.compiler.bound:
            self.compiler.bind(self.decode, self.sampler)
        model = StepModel(
            self.compiler.forward if compiled else self.decode,
            self.compiler.sample if compiled else self.sampler,
            self.cache,
            self.config.vocab_size,
            self.pad_token_id,
            self.device,
            self.step_precision,
            compiled,
        )
        if self.static and shared:
            if self._static is None:
                routers = [layer.router for layer in self.layers if layer.router is not None]
                moe = (len(routers), self.moe.routing.top_k, routers[0].shape[1]) if routers else None
                buffers = StepBuffers.allocate(self.batch_size, self.config.vocab_size, self.device, moe)
                self._static = StaticStep(model, buffers, self.graphs)
            return self._static
        return PlainStep(model)

    def decode(self, layers, tokens, positions, caches, record: bool):
        """One decode step of every cache row: the logits [B, V] of each row's next token after feeding
        `tokens` [B] at `positions` [B] (cache views up to the furthest position + 1 when eager, the call's
        whole width when compiled) and, when `record`, each MoE layer's (experts, router logits)."""
        bias = decode_bias(positions, caches[0][0].shape[2], self.dtype, self.attention.mask_layout)
        routes: list | None = [] if record else None
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        site = Site(rows, positions, bias)
        logits = self.forward(layers, tokens[:, None], positions[:, None], caches, site, routes=routes)
        return logits, routes
