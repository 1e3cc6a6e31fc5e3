"""The bucketed model: pad each prompt up to a bucket, run that bucket's compiled graph, trim the results.

    model = ttftc.compile(hf_model, ttftc.Config(buckets=(128, 256, 512)))
    out = model(input_ids)                      # .logits [B, S, V], .past_key_values, .kv_len, .bucket
    out = model(input_ids, logits_to_keep=1)    # logits of each sequence's last real token only: [B, 1, V]

Every prompt of a batch is packed to the left and right-padded: real token t of a sequence sits at position t,
as if it ran alone. With causal attention a real position never reads a later one, so the padded tail cannot
change it; the bucketing plan proves that from the graph before any bucket is used. Results are put back in
the caller's layout (left padding stays left padding, as the caller's attention mask says).

Graphs come from a GraphSource: compiled on first use (and kept in the compile cache), or loaded from an AOT
artifact. Either way they are plain aten graphs called directly, so a warm bucket never recompiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ttftc.buckets.program import GraphProgram, GraphSignature
from ttftc.buckets.plan import BucketPlan
from ttftc.buckets.table import bucket_for
from ttftc.cache.store import default_cache
from ttftc.config import OVERSIZE_POLICIES, Config


class PromptTooLongError(ValueError):
    """A prompt is longer than the largest bucket and Config.on_oversize is "error"."""


class GraphSource(Protocol):
    """Where a BucketedModel gets its graphs and its plan."""

    plan: BucketPlan
    max_positions: Optional[int]
    vocab_size: Optional[int]  # token ids must lie in [0, vocab_size); None: unknown, not checked
    takes_positions: bool

    def get(self, signature: GraphSignature) -> GraphProgram: ...

    def dynamic(self, logits: str, kv: bool) -> Optional[Callable[[dict], dict]]:
        """A runner for any length (no buckets), or None when this source cannot compile."""


@dataclass
class BucketedOutput:
    """logits: [B, S, V] for logits_to_keep=0 (S = the caller's input width), [B, 1, V] for logits_to_keep=1.
    past_key_values: per layer (keys, values) [B, Hkv, S, D], in the caller's layout; None without use_cache.
    kv_len: [B] real tokens per sequence. bucket: the padded length used, or None when the prompt ran dynamically.
    """

    logits: torch.Tensor
    past_key_values: Optional[tuple[tuple[torch.Tensor, torch.Tensor], ...]]
    kv_len: torch.Tensor
    bucket: Optional[int]

    def to_cache(self):
        """The KV as a transformers DynamicCache, for model.generate(..., past_key_values=...)."""
        from transformers import DynamicCache  # lazy: an artifact's serving path (ttftc.load) runs without transformers

        if self.past_key_values is None:
            raise ValueError("this output has no KV: call the model with use_cache=True")
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(self.past_key_values):
            cache.update(keys, values, layer)
        return cache


@dataclass(frozen=True)
class _Prompt:
    """A batch normalised to left-packed rows: row b holds its `lengths[b]` real tokens first."""

    input_ids: torch.Tensor  # [B, S_in], the caller's tensor
    lengths: torch.Tensor  # [B]
    starts: torch.Tensor  # [B], where each row's tokens start in the caller's layout
    position_ids: Optional[torch.Tensor]
    packed: bool  # True when every row starts at 0 (no repacking needed)

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @functools.cached_property  # read per restored output (logits and every layer's K and V): one reduction
    def longest(self) -> int:
        return int(self.lengths.max())


def _normalise(input_ids: torch.Tensor, attention_mask, position_ids) -> _Prompt:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = attention_mask.unsqueeze(0) if attention_mask is not None else None
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {tuple(input_ids.shape)}")
    batch, width = input_ids.shape
    if position_ids is not None and tuple(position_ids.shape) != (batch, width):
        position_ids = position_ids.expand(batch, width)
    if attention_mask is None:
        lengths = torch.full((batch,), width, dtype=torch.long)
        return _Prompt(input_ids, lengths, torch.zeros(batch, dtype=torch.long), position_ids, True)
    mask = attention_mask.to("cpu").bool()
    if tuple(mask.shape) != (batch, width):
        raise ValueError(f"attention_mask must be [batch, seq] = {(batch, width)}, got {tuple(mask.shape)}")
    lengths = mask.sum(dim=1)
    if (lengths == 0).any():
        row = int((lengths == 0).nonzero()[0])
        raise ValueError(f"attention_mask row {row} has no tokens; every prompt needs at least one")
    starts = mask.int().argmax(dim=1)
    cols = torch.arange(width)
    inside = (cols[None, :] >= starts[:, None]) & (cols[None, :] < (starts + lengths)[:, None])
    if not torch.equal(inside, mask):
        row = int((inside != mask).any(dim=1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} has gaps; bucketed prefill needs each prompt's tokens contiguous "
            "(left or right padding only)"
        )
    return _Prompt(input_ids, lengths, starts, position_ids, bool((starts == 0).all()))


def _check_token_ids(prompt: _Prompt, vocab_size: Optional[int]) -> None:
    """Every real token id is a row of the embedding: an id outside it would fail deep inside the graph (an
    IndexError on CPU, a device-side assert on CUDA). Padding slots are not read, so they are not checked."""
    ids = prompt.input_ids
    if vocab_size is None or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
        return
    cols = torch.arange(prompt.width)
    real = (cols[None, :] >= prompt.starts[:, None]) & (cols[None, :] < (prompt.starts + prompt.lengths)[:, None])
    bad = real & ((ids.cpu() < 0) | (ids.cpu() >= vocab_size))
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"token id {int(ids[row, col])} (batch row {row}, position {col}) is outside the "
                         f"vocabulary [0, {vocab_size}); token ids must come from this model's tokenizer")


def _gather_rows(x: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """x[b, starts[b] + j] for j < width (clamped at the end of x): each row shifted to start at 0."""
    cols = (starts[:, None] + torch.arange(width)[None, :]).clamp(max=x.shape[1] - 1).to(x.device)
    return x.gather(1, cols)


class BucketedModel:
    """A prefill model that runs every prompt in a fixed-shape graph; see the module docstring."""

    def __init__(self, source: GraphSource, *, device: torch.device, on_oversize: str = "error"):
        if on_oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"on_oversize must be one of {OVERSIZE_POLICIES}, got {on_oversize!r}")
        self.source = source
        self.device = device
        self.on_oversize = on_oversize

    @property
    def plan(self) -> BucketPlan:
        return self.source.plan

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    def explain(self) -> str:
        return self.plan.describe()

    @property
    def graphs_compiled(self) -> int:
        """Graphs this process traced and compiled for this model. Only a source that compiles counts them (an
        artifact's graphs are all loaded), so a source without the count has compiled none."""
        return getattr(self.source, "compiles", 0)

    @property
    def graphs_loaded(self) -> int:
        """Graphs this process loaded from the compile cache instead of compiling them."""
        return getattr(self.source, "cache_hits", 0)

    def warmup(self, buckets=None, *, batch_sizes=(1,), logits_to_keep=(0,), use_cache=(True,)) -> None:
        """Compile (or load) the graphs of the given buckets (all by default) now, not on first use."""
        if not self.plan.safe:
            return
        for bucket in buckets or self.buckets:
            for batch in batch_sizes:
                for keep in logits_to_keep:
                    for kv in use_cache:
                        self.source.get(GraphSignature(bucket, batch, _logits_mode(keep), bool(kv)))

    # -- serving path ------------------------------------------------------------------------------------
    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, logits_to_keep: int = 0,
                 use_cache: bool = True, **unused) -> BucketedOutput:
        unsupported = {k for k, v in unused.items() if v is not None} - {"return_dict"}
        if unsupported:
            raise TypeError(f"BucketedModel does not support the arguments {sorted(unsupported)}")
        mode = _logits_mode(logits_to_keep)
        prompt = _normalise(input_ids, attention_mask, position_ids)
        _check_token_ids(prompt, self.source.vocab_size)
        with torch.no_grad():
            if not self.plan.safe:
                ragged = bool((prompt.lengths != prompt.width).any())
                return self._run_unbucketed(prompt, mode, use_cache, per_row=ragged)
            bucket = bucket_for(prompt.longest, self.buckets)
            if bucket is None:
                if self.on_oversize == "error":
                    raise PromptTooLongError(
                        f"prompt of {prompt.longest} tokens is longer than the largest bucket ({self.buckets[-1]}). "
                        "Add a larger bucket to Config.buckets, or set Config(on_oversize='dynamic') to run such "
                        "prompts with dynamic shapes."
                    )
                return self._run_unbucketed(prompt, mode, use_cache, per_row=False)
            program = self.source.get(GraphSignature(bucket, prompt.input_ids.shape[0], mode, bool(use_cache)))
            outputs = program(self._padded_inputs(prompt, bucket, mode))
            return self._unpad(outputs, prompt, mode, bucket)

    def _padded_inputs(self, prompt: _Prompt, width: int, mode: str) -> dict[str, torch.Tensor]:
        ids = prompt.input_ids.to(self.device, torch.long)
        real = torch.arange(width, device=self.device)[None, :] < prompt.lengths.to(self.device)[:, None]
        if prompt.packed and width >= prompt.width:
            padded = torch.nn.functional.pad(ids, (0, width - prompt.width))
        else:
            padded = _gather_rows(ids, prompt.starts, width)
        # Padding tokens are token 0: any valid id will do, their results are discarded.
        tensors = {"input_ids": torch.where(real, padded, torch.zeros_like(padded))}
        if self.source.takes_positions:
            tensors["position_ids"] = self._padded_positions(prompt, width, real)
        if mode == "last":
            tensors["last_index"] = (prompt.lengths - 1).to(self.device)
        return tensors

    def _padded_positions(self, prompt: _Prompt, width: int, real: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(width, device=self.device).expand(prompt.input_ids.shape[0], width)
        if prompt.position_ids is None:
            positions = steps
        else:
            given = _gather_rows(prompt.position_ids.to(self.device), prompt.starts, width)
            last = given.gather(1, (prompt.lengths - 1).to(self.device)[:, None])
            # Padded slots continue counting from each row's last real position.
            positions = torch.where(real, given, last + steps - prompt.lengths.to(self.device)[:, None] + 1)
        limit = self.source.max_positions
        if limit is not None:
            positions = positions.clamp(max=limit - 1)
        return positions.contiguous()

    def _unpad(self, outputs: dict[str, torch.Tensor], prompt: _Prompt, mode: str, bucket: Optional[int]):
        logits = outputs["logits"]
        if mode == "all":
            logits = self._restore_layout(logits, prompt, seq_dim=1)
        kv = None
        if "k0" in outputs:
            layers = (len(outputs) - 1) // 2
            kv = tuple(
                (self._restore_layout(outputs[f"k{i}"], prompt, seq_dim=2),
                 self._restore_layout(outputs[f"v{i}"], prompt, seq_dim=2))
                for i in range(layers)
            )
        return BucketedOutput(logits, kv, prompt.lengths.clone(), bucket)

    @staticmethod
    def _restore_layout(x: torch.Tensor, prompt: _Prompt, *, seq_dim: int) -> torch.Tensor:
        """Trim a padded [.., bucket, ..] result to the caller's width, moving rows back where they started."""
        if x.shape[seq_dim] < prompt.longest:
            raise ValueError(f"the model returned {x.shape[seq_dim]} positions (dim {seq_dim} of {tuple(x.shape)}) "
                             f"for a {prompt.longest}-token prompt; the bucketed runtime needs one per token, as a "
                             "causal LM's logits and KV cache have: compile this model with torch.compile instead")
        width = prompt.width
        if prompt.packed and x.shape[seq_dim] >= width:
            return x.narrow(seq_dim, 0, width)
        out = x.new_zeros(x.shape[:seq_dim] + (width,) + x.shape[seq_dim + 1:])
        for b in range(x.shape[0]):
            start, length = int(prompt.starts[b]), int(prompt.lengths[b])
            out[b].narrow(seq_dim - 1, start, length).copy_(x[b].narrow(seq_dim - 1, 0, length))
        return out

    def _run_unbucketed(self, prompt: _Prompt, mode: str, use_cache: bool, *, per_row: bool) -> BucketedOutput:
        runner = self.source.dynamic(mode, bool(use_cache))
        if runner is None:
            why = self.plan.reason if not self.plan.safe else (
                f"the prompt ({prompt.longest} tokens) is longer than the largest bucket ({self.buckets[-1]})")
            raise PromptTooLongError(
                f"this model has no graph for the prompt: {why}. It was loaded from an artifact, which cannot "
                "compile; rebuild the artifact with a larger bucket (ttftc compile ... --buckets ...)."
            )
        if not per_row:
            outputs = runner(self._padded_inputs(prompt, prompt.longest, mode))
            return self._unpad(outputs, prompt, mode, None)
        # Padding is not proven safe: run every prompt at its own length, then assemble the batch.
        rows = []
        for b in range(prompt.input_ids.shape[0]):
            start, length = int(prompt.starts[b]), int(prompt.lengths[b])
            ids = prompt.input_ids[b:b + 1, start:start + length]
            positions = None if prompt.position_ids is None else prompt.position_ids[b:b + 1, start:start + length]
            single = _Prompt(ids, prompt.lengths[b:b + 1], prompt.starts[:1] * 0, positions, True)
            rows.append(runner(self._padded_inputs(single, length, mode)))
        return self._unpad(_stack_rows(rows, prompt, mode), prompt, mode, None)


def _stack_rows(rows: list[dict], prompt: _Prompt, mode: str) -> dict[str, torch.Tensor]:
    """Per-sequence results (each at its own length) as one right-padded batch."""
    stacked = {}
    for name in rows[0]:
        if name == "logits" and mode == "last":
            stacked[name] = torch.cat([row[name] for row in rows], dim=0)
            continue
        seq_dim = 1 if name == "logits" else 2
        parts = []
        for row in rows:
            x = row[name]
            pad = [0, 0] * (x.dim() - seq_dim - 1) + [0, prompt.longest - x.shape[seq_dim]]
            parts.append(torch.nn.functional.pad(x, pad))
        stacked[name] = torch.cat(parts, dim=0)
    return stacked


def _logits_mode(logits_to_keep) -> str:
    if logits_to_keep in (0, None):
        return "all"
    if logits_to_keep == 1:
        return "last"
    raise ValueError(
        f"logits_to_keep={logits_to_keep!r} is not supported by the bucketed model: use 0 (every position) or 1 "
        "(each sequence's last real token)"
    )


_DEFAULT_CACHE = object()


def compile_bucketed(model: torch.nn.Module, config: Config, *, cache=_DEFAULT_CACHE) -> BucketedModel:
    """A BucketedModel over `model`: graphs are compiled per bucket on first use (see `warmup`).

    cache: a ttftc.cache.CompileCache, None for no cache, or (default) the default on-disk cache.
    """
    from ttftc.buckets.compiled import CompiledGraphs, model_device  # lazy: Dynamo, which ttftc.load never needs

    if cache is _DEFAULT_CACHE:
        cache = default_cache()
    source = CompiledGraphs(model, config, cache=cache)
    return BucketedModel(source, device=model_device(model, config), on_oversize=config.on_oversize)
