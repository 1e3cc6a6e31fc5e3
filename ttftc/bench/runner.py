"""The measurement loop: every variant, every length, interleaved in one process, into one JSON document.

Order of a run (all inside `torch.inference_mode()`, with every compile cache in a fresh temporary directory):
1. GEMM peaks per dtype (roofline.py), sampled again in every measured round; the best sample counts.
2. Build every variant (a variant that cannot be built is recorded as failed; one whose dependency is missing
   as skipped; neither stops the others).
3. For each length: each variant's first call in this process (`inprocess_first_call_s`), then `warmup`
   unmeasured runs of the workload, then `repeats` measured rounds. In every round each variant runs the
   workload once, in an order rotated by one each round, so background load and thermal drift spread evenly.
4. For each length L, one call of every variant at a length never seen before (L+1, or the next free one):
   `unseen_len_first_call_s`, the cost of a prompt length the process has not met (a recompile, or not).
5. First calls with cold caches, each in a fresh process (cold_start.py), once the models here are freed.
A variant that raises at some length is recorded as failed at that length, with the reason; the others go on.

On CUDA every in-process time is taken with CUDA events (timing.DeviceClock), the measured requests' TTFTs too,
except for workloads with arrival times, whose TTFT includes waiting in the queue: only the host clock sees that.
Each row on a GPU that devices.json knows also carries the bound from the GPU's published peak, next to the bound
from the GEMM peak measured in the run.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.metadata
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

import ttftc
from ttftc.autotune.cache import default_cache_dir
from ttftc.capabilities import probe
from ttftc.codegen.cpu._allocator import keep_freed_pages
from ttftc.codegen.cpu._blas import measured_decode_backend, measured_gemm_backend
from ttftc.codegen.cpu.attention import describe_kernel_choice
from ttftc.codegen.cpu.int8_linear import int8_gemm_choice
from ttftc.codegen.cpu.measured import cpu_snapshot, others_busy_since

from ttftc.bench.ablation import AblationStep, ablation_steps
from ttftc.bench.caches import fresh_cache_dirs
from ttftc.bench.cold_start import measure_cold_first_call
from ttftc.bench.devices import DeviceSpec, device_for_name
from ttftc.bench.errors import BenchInputError
from ttftc.bench.models import ModelSource, ModelSpec, example_prompt, max_positions, model_config, resolve_model
from ttftc.bench.progress import Progress
from ttftc.bench.roofline import GemmPeak, PeakMeter, bound_ms, describe_prefill, prefill_flops
from ttftc.bench.timing import DeviceClock, summarize_ms, time_call
from ttftc.bench.variants import DEFAULT_VARIANTS, Prepared, Variant, autotune_cache_for_variants, get_variant
from ttftc.bench.workloads import (DEFAULT_WORKLOAD, Request, Server, ServeTarget, Workload, WorkloadContext,
                                   get_workload)

SCHEMA_VERSION = 1
FIRST_CALL_MODES = ("subprocess", "in-process", "skip")
PREFILL_DESCRIPTION = (
    "model(input_ids, logits_to_keep=1, use_cache=True) under torch.inference_mode(), batch 1: "
    "the whole prompt, KV cache kept, logits of the last position only"
)


@dataclass(frozen=True)
class BenchSettings:
    model: str
    seqs: tuple[int, ...] = (128, 512, 2048)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    repeats: int = 10
    warmup: int = 1
    ablation: bool = False  # add the ablation steps (ablation.py) to the variants
    workload: str = DEFAULT_WORKLOAD
    first_call: str = "subprocess"  # how first_call_s is measured: see FIRST_CALL_MODES and the README
    device: str = "cpu"
    peak_size: int = 2048
    peak_repeats: int = 4
    first_call_timeout_s: float = 600.0
    progress: bool = True
    autotune_cache: Optional[str] = None  # what `tuned=on` variants read (None: the default autotune cache)


@dataclass
class _Plan:
    settings: BenchSettings
    spec: ModelSpec
    variants: list[Variant]
    workload: Workload
    ablation: list[AblationStep]


@dataclass
class _Cell:
    """What is known about one (variant, seq) while the run goes on."""

    status: str = "ok"
    samples: list[float] = field(default_factory=list)
    inprocess_first_call_s: Optional[float] = None
    unseen_len: Optional[int] = None
    unseen_len_first_call_s: Optional[float] = None
    first_call_s: Optional[float] = None
    first_call_error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def plan(settings: BenchSettings) -> _Plan:
    """Validate everything the user gave before any expensive work; raise BenchInputError on bad input."""
    if not settings.seqs:
        raise BenchInputError("no sequence lengths given")
    if any(s <= 0 for s in settings.seqs) or len(set(settings.seqs)) != len(settings.seqs):
        raise BenchInputError(f"sequence lengths must be distinct positive integers, got {list(settings.seqs)}")
    if settings.repeats < 1 or settings.warmup < 0:
        raise BenchInputError("--repeats must be at least 1 and --warmup at least 0")
    if settings.first_call not in FIRST_CALL_MODES:
        raise BenchInputError(f"unknown first-call mode {settings.first_call!r}; modes: {', '.join(FIRST_CALL_MODES)}")
    spec = resolve_model(settings.model)
    limit = max_positions(model_config(spec))
    longest = max(settings.seqs) + len(settings.seqs)  # the unseen lengths go a little past the longest
    if limit is not None and longest > limit:
        raise BenchInputError(f"--seq up to {max(settings.seqs)} does not fit the model's {limit} positions")
    steps = ablation_steps() if settings.ablation else []
    names = list(dict.fromkeys([*settings.variants, *(s.variant for s in steps)]))
    if not names:
        raise BenchInputError("no variants to run")
    variants = [get_variant(n) for n in names]
    if settings.autotune_cache is not None and not os.path.isdir(settings.autotune_cache):
        raise BenchInputError(f"--autotune-cache {settings.autotune_cache!r} is not a directory")
    return _Plan(settings, spec, variants, get_workload(settings.workload), steps)


def _autotune_dir(settings: BenchSettings) -> str:
    # Resolved before fresh_cache_dirs() moves TTFTC_CACHE_DIR, so the default is the user's cache, not an empty one.
    return settings.autotune_cache or str(default_cache_dir())


@contextlib.contextmanager
def _dynamo_limits(compiled_variants: int) -> Iterator[None]:
    # Every compiled variant compiles the same forward code object; Dynamo's recompile limit (8 per code
    # object) would otherwise be shared by all of them and silently send the later ones to eager. A variant
    # that still hits the raised limit fails loudly instead of being timed as eager.
    budget = 8 + 8 * max(1, compiled_variants)
    with torch._dynamo.config.patch(recompile_limit=budget, fail_on_recompile_limit_hit=True):
        yield


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 300 else text[:299] + "…"


def _unseen_lengths(seqs: tuple[int, ...]) -> dict[int, int]:
    taken = set(seqs)
    result = {}
    for seq in seqs:
        candidate = seq + 1
        while candidate in taken:
            candidate += 1
        taken.add(candidate)
        result[seq] = candidate
    return result


def run_bench(settings: BenchSettings) -> dict:
    """Run the benchmark and return the JSON document (schema in README.md, "Benchmarks: ttftc bench")."""
    p = plan(settings)
    s = p.settings
    started = time.perf_counter()
    cells = {(v.name, seq): _Cell() for v in p.variants for seq in s.seqs}
    per_seq_steps = 1 + s.warmup + s.repeats + 1
    cold_steps = len(p.variants) * len(s.seqs) if s.first_call == "subprocess" else 0
    progress = Progress(3 + len(p.variants) * (len(s.seqs) * per_seq_steps + 1) + cold_steps, enabled=s.progress)
    details: dict[str, dict] = {}
    autotune_dir = _autotune_dir(s)
    try:
        torch._dynamo.reset()
        with fresh_cache_dirs(), autotune_cache_for_variants(autotune_dir):
            progress.note(f"ttftc bench: {p.spec.name} on {s.device}, {torch.get_num_threads()} threads")
            if s.device == "cpu":
                # Set before anything runs, so every variant (peers too) and the peak see one allocator.
                progress.note(f"ttftc bench: {keep_freed_pages()}, for every variant")
            if any("tuned=on" in v.name for v in p.variants):
                progress.note(f"tuned=on variants read the autotune cache {autotune_dir}")
            meter = PeakMeter(device=s.device, size=s.peak_size)
            meter.sample(s.peak_repeats)
            progress.step("GEMM peaks", 3)
            source = ModelSource(p.spec, s.device)
            shape = describe_prefill(source.base)
            model_info = _model_info(p.spec, source.base)
            prepared = _build_all(p, source, cells, progress)
            progress.add_total(-(len(p.variants) - len(prepared)) * len(s.seqs) * per_seq_steps)
            compiled = sum(1 for v in p.variants if v.compiles and v.name in prepared)
            timed_from = cpu_snapshot()
            with _dynamo_limits(compiled), torch.inference_mode():
                for seq in s.seqs:
                    _measure_length(p, seq, source.config.vocab_size, prepared, cells, progress, meter)
                for seq, unseen in _unseen_lengths(s.seqs).items():
                    _measure_unseen(p, seq, unseen, source.config.vocab_size, prepared, cells, progress)
            others_busy = others_busy_since(timed_from)
            for name, built in prepared.items():
                with contextlib.suppress(Exception):
                    details[name] = built.details()
            notes = {name: built.header_note for name, built in prepared.items() if built.header_note}
            del prepared
            gc.collect()
            peaks = meter.peaks()
            del meter
            if s.first_call == "subprocess":
                _measure_cold(p, source, cells, progress)
            source.free()
            gc.collect()
    finally:
        progress.close()
    return _document(p, peaks, shape, model_info, cells, details, time.perf_counter() - started, autotune_dir, notes,
                     others_busy)


def _build_all(p: _Plan, source: ModelSource, cells: dict, progress: Progress) -> dict[str, Prepared]:
    prepared = {}
    for variant in p.variants:
        skip = variant.skip_reason()
        if skip:
            status = f"skipped: {skip}"
        else:
            try:
                prepared[variant.name] = variant.build(source)
                status = "ok"
                if prepared[variant.name].header_note:
                    progress.note(f"{variant.name}: {prepared[variant.name].header_note}")
            except Exception as exc:
                status = f"failed: {_reason(exc)}"
        if status != "ok":
            progress.note(f"{variant.name}: {status}")
            for seq in p.settings.seqs:
                cells[(variant.name, seq)].status = status
        progress.step(f"built {variant.name}")
    return prepared


def _target(name: str, built: Prepared, device: str) -> ServeTarget:
    return ServeTarget(model=built.model, prefill=built.prefill, variant=name, device=device)


def _measure_length(
    p: _Plan, seq: int, vocab: int, prepared: dict, cells: dict, progress: Progress, meter: PeakMeter
) -> None:
    s = p.settings
    ids = example_prompt(vocab, seq, device=s.device)
    alive = []
    for name, built in prepared.items():
        cell = cells[(name, seq)]
        try:
            progress.step(f"{name} first call at {seq}")
            cell.inprocess_first_call_s = time_call(built.prefill, ids, device=s.device)
            for w in range(s.warmup):
                progress.step(f"{name} warm-up at {seq}")
                ctx = WorkloadContext(seq=seq, vocab_size=vocab, seed=1_000_000 + w, device=s.device)
                _replay(p.workload, p.workload.requests(ctx), p.workload.make_server(_target(name, built, s.device)),
                        s.device)
            alive.append(name)
        except Exception as exc:
            cell.status = f"failed: {_reason(exc)}"
            progress.note(f"{name} at {seq}: {cell.status}")
    for r in range(s.repeats):
        meter.sample()  # the peak is sampled in the same stretch of time as the TTFTs
        ctx = WorkloadContext(seq=seq, vocab_size=vocab, seed=r, device=s.device)
        shift = r % len(alive) if alive else 0
        for name in alive[shift:] + alive[:shift]:
            cell = cells[(name, seq)]
            progress.step(f"{name} at {seq}, repeat {r + 1}/{s.repeats}")
            if not cell.ok:
                continue
            built = prepared[name]
            try:
                server = p.workload.make_server(_target(name, built, s.device))
                cell.samples.extend(_replay(p.workload, p.workload.requests(ctx), server, s.device))
            except Exception as exc:
                cell.status = f"failed: {_reason(exc)}"
                progress.note(f"{name} at {seq}: {cell.status}")
    for name in prepared:
        if name not in alive:
            progress.step(n=s.repeats)  # keep the bar's total honest for variants that fell out


def _replay(workload: Workload, requests: list[Request], server: Server, device: str) -> list[float]:
    """The measured requests' TTFTs in seconds: the workload's own replay, its times taken by the device's clock.

    Requests issued back to back through the default one-at-a-time replay are timed one by one with DeviceClock
    (CUDA events on CUDA). With arrival times the replay's host clock stands, since queueing is part of those
    TTFTs; so do the clocks of a workload with its own replay (its server is not a plain callable to wrap).
    """
    clock = DeviceClock(device)
    own_replay = type(workload).replay is not Workload.replay
    if not clock.uses_cuda_events or own_replay or any(r.arrival_s is not None for r in requests):
        return workload.replay(requests, server, device=device)
    spans: list[tuple[bool, float]] = []

    def timed(request: Request):
        mark = clock.start()
        out = server(request)
        spans.append((request.measured, clock.stop(mark)))
        return out

    workload.replay(requests, timed, device=device)
    return [seconds for measured, seconds in spans if measured]


def _measure_unseen(p: _Plan, seq: int, unseen: int, vocab: int, prepared: dict, cells: dict, progress) -> None:
    s = p.settings
    ids = example_prompt(vocab, unseen, seed=1, device=s.device)
    for name, built in prepared.items():
        cell = cells[(name, seq)]
        progress.step(f"{name} at unseen length {unseen}")
        if not cell.ok:
            continue
        cell.unseen_len = unseen
        try:
            cell.unseen_len_first_call_s = time_call(built.prefill, ids, device=s.device)
        except Exception as exc:
            cell.status = f"failed: at unseen length {unseen}: {_reason(exc)}"
            progress.note(f"{name}: {cell.status}")


def _measure_cold(p: _Plan, source: ModelSource, cells: dict, progress: Progress) -> None:
    s = p.settings
    with tempfile.TemporaryDirectory(prefix="ttftc-bench-model-") as scratch:
        model_dir = source.save(os.path.join(scratch, "model"))
        source.free()
        gc.collect()
        for variant in p.variants:
            for seq in s.seqs:
                cell = cells[(variant.name, seq)]
                progress.step(f"{variant.name} cold first call at {seq}")
                if not cell.ok:
                    continue
                cell.first_call_s, cell.first_call_error = measure_cold_first_call(
                    model_dir, variant.name, seq, device=s.device, timeout_s=s.first_call_timeout_s
                )
                if cell.first_call_error:
                    progress.note(f"{variant.name} cold first call at {seq}: {cell.first_call_error}")


def _model_info(spec: ModelSpec, model: torch.nn.Module) -> dict[str, Any]:
    config = model.config
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
    return {
        "name": spec.name,
        "preset": spec.is_preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {k: getattr(config, k, None) for k in keys},
    }


def _capabilities(device: str) -> str:
    """The probe's answer, and on CPU the GEMMs and attention kernel measured and chosen here, with their times and
    whether each was measured now or loaded from the machine's record (and when it was measured)."""
    described = probe(torch.device(device).type).describe()
    if torch.device(device).type == "cpu":
        chosen = [int8_gemm_choice().describe(), measured_gemm_backend(torch.float32).describe(),
                  measured_decode_backend(torch.float32).describe(), describe_kernel_choice(torch.float32)]
        described += "".join(f"; {text}" for text in chosen)
    return described


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _published_device(device: str) -> Optional[DeviceSpec]:
    """The devices.json entry of the GPU this run is on, whose data-sheet peaks give a second roofline bound."""
    if torch.device(device).type != "cuda":
        return None
    return device_for_name(_device_name(device))


def _versions() -> dict[str, Optional[str]]:
    versions: dict[str, Optional[str]] = {"ttftc": ttftc.__version__, "torch": torch.__version__, "python": platform.python_version()}
    for dist in ("transformers", "triton", "torchao", "openvino", "nncf"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _document(p: _Plan, peaks: dict[str, GemmPeak], shape, model_info, cells, details, elapsed_s: float,
              autotune_dir: Optional[str] = None, notes: Optional[dict[str, str]] = None,
              others_busy: Optional[float] = None) -> dict:
    s = p.settings
    gpu = _published_device(s.device)
    results = []
    for variant in p.variants:
        for seq in s.seqs:
            cell = cells[(variant.name, seq)]
            flops = prefill_flops(shape, seq)
            bound = bound_ms(flops, peaks.get(variant.dtype))
            row: dict[str, Any] = {
                "variant": variant.name,
                "seq": seq,
                "status": cell.status,
                "workload": p.workload.name,
                "dtype": variant.dtype,
                "samples": len(cell.samples),
                "ttft_ms_p50": None, "ttft_ms_p95": None, "ttft_ms_p99": None, "ttft_ms_mean": None, "ttft_ms_min": None,
                "first_call_s": cell.first_call_s if s.first_call == "subprocess" else (
                    cell.inprocess_first_call_s if s.first_call == "in-process" else None),
                "first_call_mode": s.first_call,
                "inprocess_first_call_s": cell.inprocess_first_call_s,
                "unseen_len": cell.unseen_len,
                "unseen_len_first_call_s": cell.unseen_len_first_call_s,
                "flops": flops,
                "bound_ms": bound,
                "efficiency": None,
            }
            if cell.first_call_error:
                row["first_call_error"] = cell.first_call_error
            if gpu is not None:
                row["published_bound_ms"] = flops / gpu.peak_flops(variant.dtype)[0] * 1e3
            if cell.ok and cell.samples:
                row.update(summarize_ms(cell.samples))
                if bound is not None:
                    row["efficiency"] = bound / row["ttft_ms_p50"]
                if gpu is not None:
                    row["published_efficiency"] = row["published_bound_ms"] / row["ttft_ms_p50"]
            if variant.name in details:
                row["details"] = details[variant.name]
            results.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": s.device,
        "device_name": _device_name(s.device),
        "capabilities": _capabilities(s.device),
        "malloc": keep_freed_pages() if s.device == "cpu" else None,
        "threads": torch.get_num_threads(),
        # cores that other processes kept busy, on average, while the variants were timed: a figure taken beside
        # them is a shared machine's, not the machine's
        "others_busy_cores": None if others_busy is None else round(others_busy, 2),
        "cores": os.cpu_count(),
        "versions": _versions(),
        "variant_notes": notes or {},  # per variant, what a peer chose (Prepared.header_note)
        "model": model_info,
        "settings": {
            "seqs": list(s.seqs),
            "variants": [v.name for v in p.variants],
            "repeats": s.repeats,
            "warmup": s.warmup,
            "workload": p.workload.name,
            "first_call": s.first_call,
            "prefill": PREFILL_DESCRIPTION,
            "autotune_cache": autotune_dir,
            "timing": DeviceClock(s.device).name,
        },
        "published_peak": None if gpu is None else {
            "device": gpu.key, "name": gpu.name, "tflops": gpu.peak_tflops, "source": gpu.source},
        "peak": {d: pk.gflops for d, pk in peaks.items()},
        "peak_details": {
            d: {"unit": "GOP/s" if d == "int8" else "GFLOP/s", "op": pk.op, "size": pk.size, "samples": pk.samples,
                "error": pk.error}
            for d, pk in peaks.items()
        },
        "results": results,
        "ablation": [{"step": st.label, "variant": st.variant} for st in p.ablation] if s.ablation else None,
        "workload_table": p.workload.table(),
        "elapsed_s": elapsed_s,
    }
