"""The chunk size of chunked prefill as a tuned knob, in the same persistent cache as the kernel configs.

`ttftc autotune MODEL --chunk-sizes 256,512,1024` times, per prompt length in `--buckets`, one prefill through
`ttftc.runtime.PrefillEngine` with the whole prompt in one forward (the default) and with each chunk size shorter
than the prompt, and stores the fastest. A chunked candidate must produce the whole-prompt logits (within a
precision-dependent tolerance) to count. `tuned_chunk_table(model)` reads the stored sizes back as a
`ttftc.runtime.ChunkTable`; a `PrefillEngine(model, chunk_size=tuned_chunk_table(model))` then uses the tuned size
for the nearest tuned prompt length (the smallest one not shorter than the prompt, else the longest). The runtime
never reads the autotune cache itself: it is the lower layer, and this module hands it the table.

An entry is keyed like a kernel's (autotune/cache.py): device name (CPU model and thread count, or GPU name), the
op name "chunked_prefill", a "provider" naming how the model runs (`runner_of`: "eager", "compiled" for a foreign
torch.compile backend, or "ttftc-<precision>:<Config digest>"), a shape signature of the model's config plus the
prompt length, and the parameter dtype; the versions of ttftc, torch and triton are checked on read.

On one CPU prompt, a single forward is usually fastest (chunks re-read the growing KV and pay one forward's fixed
costs per chunk: references.md 6.4); chunking pays off for memory and for other requests' latency. The tuner only
records what was measured, so the default stays unless a chunk size really wins on this machine.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping, Optional, Sequence

import torch

from ttftc.autotune.cache import AutotuneCache, TuneKey
from ttftc.autotune.keys import device_name
from ttftc.autotune.space import Problem
from ttftc.dynamo_backend import TtftcBackend
from ttftc.runtime.chunked import ChunkTable
from ttftc.runtime.engine import PrefillEngine
from ttftc.tuning.timing import WallTimer
from ttftc.tuning.tuner import TuneResult, _progress, measure_candidates

OP = "chunked_prefill"
# Largest |chunked - whole| logit difference accepted, relative to the largest |logit|, per ttftc precision.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "int8": 1e-1}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def _ttftc_backend_of(model) -> Optional[object]:
    """The TtftcBackend a torch.compile'd module was compiled with, found through Dynamo's wrappers (private
    attributes, so best effort: when they move, the model counts as "compiled" on the tuning and the using side
    alike)."""
    obj = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if obj is None or isinstance(obj, TtftcBackend):
            return obj
        obj = getattr(obj, "_torchdynamo_orig_backend", None) or getattr(obj, "compiler_fn", None)
    return None


def runner_of(model: torch.nn.Module) -> str:
    """How `model` runs, as far as a tuned chunk size can depend on it."""
    if _unwrap(model) is model:
        return "eager"
    backend = _ttftc_backend_of(model)
    if backend is None:
        return "compiled"
    config = backend.config
    return f"ttftc-{config.precision}:{config.digest()[:10]}"


def _text_config(model: torch.nn.Module):
    config = _unwrap(model).config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_signature(model: torch.nn.Module) -> str:
    """The shapes that decide a prefill's cost: family, widths, depth, heads, vocabulary, attention kind."""
    base = _unwrap(model)
    config = base.config
    text = _text_config(model)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    parts = [
        getattr(text, "model_type", type(base).__name__),
        f"h{text.hidden_size}",
        f"i{getattr(text, 'intermediate_size', None) or getattr(text, 'n_inner', None) or 0}",
        f"L{text.num_hidden_layers}",
        f"heads{heads}/{kv_heads}",
        f"d{head_dim}",
        f"V{text.vocab_size}",
        f"attn={getattr(config, '_attn_implementation', None) or 'default'}",
    ]
    return " ".join(str(p) for p in parts)


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(_unwrap(model).parameters())


def _shapes_prefix(model: torch.nn.Module) -> str:
    return f"{model_signature(model)};prompt="


def chunk_key(model: torch.nn.Module, prompt_len: int) -> TuneKey:
    param = _param(model)
    return TuneKey(device_name(param.device.type), OP, runner_of(model), f"{_shapes_prefix(model)}{prompt_len}",
                   str(param.dtype).replace("torch.", ""))


def tuned_chunk_sizes(model: torch.nn.Module, cache: Optional[AutotuneCache] = None) -> dict[int, Optional[int]]:
    """{tuned prompt length: best chunk size (None: the whole prompt in one forward)} for this model as it runs
    here. Never raises: a corrupt or stale cache gives one warning and no entries."""
    cache = cache if cache is not None else AutotuneCache()
    try:
        probe = chunk_key(model, 0)
        prefix = _shapes_prefix(model)
        table = {}
        for entry in cache.fresh_entries():
            key = entry.key
            if (key.op, key.provider, key.device, key.dtype) != (OP, probe.provider, probe.device, probe.dtype):
                continue
            if not key.shapes.startswith(prefix) or not key.shapes[len(prefix):].isdigit():
                continue
            chunk = entry.config.get("chunk_size")
            if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
                # a prefill step of no tokens (or of a fraction) fails at the first call; the entry is skipped now
                cache._warn_once(f"entry for {OP} has chunk_size={chunk!r}, not a positive int or null")
                continue
            table[int(key.shapes[len(prefix):])] = chunk
        return table
    except Exception as exc:  # an unusual model or a hand-edited entry must not stop a prefill
        cache._warn_once(f"tuned chunk sizes unreadable ({type(exc).__name__}: {exc})")
        return {}


def tuned_chunk_table(model: torch.nn.Module, cache: Optional[AutotuneCache] = None) -> ChunkTable:
    """The tuned chunk sizes of `model` as it runs here, for `PrefillEngine(model, chunk_size=...)`."""
    return ChunkTable(tuned_chunk_sizes(model, cache))


def pick_chunk_size(table: Mapping[int, Optional[int]], n_tokens: int) -> Optional[int]:
    """The tuned chunk size for a prefill of `n_tokens`: from the smallest tuned length >= n_tokens, else from the
    longest tuned length; None (whole prompt) when nothing is tuned."""
    return ChunkTable(table).for_tokens(n_tokens)


def chunk_candidates(prompt_len: int, chunk_sizes: Sequence[int]) -> list[Optional[int]]:
    """None (the whole prompt, the default) first, then every chunk size shorter than the prompt."""
    return [None] + sorted({int(c) for c in chunk_sizes if 0 < int(c) < prompt_len})


def _problem(model: torch.nn.Module, prompt_len: int) -> Problem:
    return Problem(OP, runner_of(model), (), (("prompt_len", prompt_len),))


def tune_chunk_sizes(
    model: torch.nn.Module,
    prompt_lens: Sequence[int],
    chunk_sizes: Sequence[int],
    *,
    cache: AutotuneCache,
    budget_s: float,
    tolerance: float = TOLERANCE["fp32"],
    timer: Optional[Callable] = None,
    progress: bool = True,
    retune: bool = False,
):
    """Time prefill through PrefillEngine at each prompt length with each chunk size; store the fastest.

    `model` runs as it will be served (eager, or compiled with the ttftc Config it will be compiled with), since
    the cache key names the runner. Returns one tuner.TuneResult per prompt length.
    """
    if not chunk_sizes or any(int(c) < 1 for c in chunk_sizes):
        raise ValueError(f"chunk sizes must be positive integers, got {list(chunk_sizes)!r}")
    param = _param(model)
    device = param.device.type
    timer = timer or WallTimer(device)
    deadline = time.monotonic() + budget_s
    vocab = _text_config(model).vocab_size
    results: list = []
    work = []
    for length in prompt_lens:
        problem = _problem(model, length)
        cached = None if retune else cache.lookup(chunk_key(model, length))
        if cached is not None:
            results.append(TuneResult(problem, length, "cached", cached.config, cached.tuned_ms, cached.default_ms))
        elif budget_s <= 0:
            results.append(TuneResult(problem, length, "skipped: time budget used up"))
        else:
            work.append((length, problem))
    bar = _progress(sum(len(chunk_candidates(n, chunk_sizes)) for n, _ in work), enabled=progress)
    try:
        for length, problem in work:
            if time.monotonic() > deadline:
                results.append(TuneResult(problem, length, "skipped: time budget used up"))
                continue
            ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            result = TuneResult(problem, length, "tuned")
            outputs: list[torch.Tensor] = []  # the whole-prompt logits (index 0) are the reference

            def run(config: dict) -> Callable[[], torch.Tensor]:
                engine = PrefillEngine(model, chunk_size=config["chunk_size"])

                def prefill() -> torch.Tensor:
                    first = engine.first_token(ids)
                    first.kv.release()
                    return first.logits

                return prefill

            def matches_whole_prompt(logits: torch.Tensor, index: int) -> bool:
                outputs.append(logits)
                return _close(logits, outputs[0], tolerance)

            configs = [{"chunk_size": chunk} for chunk in chunk_candidates(length, chunk_sizes)]
            measure_candidates(result, configs, run, matches_whole_prompt, timer=timer, deadline=deadline,
                               on_candidate=lambda: bar.update(1), wrong="logits differ from the whole-prompt prefill")
            if result.status == "tuned":
                cache.store(chunk_key(model, length), result.config, result.tuned_ms,
                            result.default_ms if not math.isnan(result.default_ms) else result.tuned_ms)
            results.append(result)
    finally:
        bar.close()
    return results


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    scale = max(1.0, float(expected.abs().max()))
    return bool(torch.isfinite(actual).all()) and float((actual - expected).abs().max()) <= tolerance * scale
