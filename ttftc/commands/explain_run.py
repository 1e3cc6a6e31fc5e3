"""`ttftc explain` run: what the parsed arguments of ttftc/commands/explain.py do."""

from __future__ import annotations

import torch

from ttftc.api import explain
from ttftc.bench.devices import DeviceSpec, get_device
from ttftc.bench.models import PREFILL_KWARGS, example_prompt, load_model, max_positions, model_config, resolve_model
from ttftc.bench.prediction import format_prediction, predict
from ttftc.bench.roofline import bound_ms, describe_prefill, measure_gemm_peak, prefill_flops
from ttftc.codegen.triton.targets import get_target
from ttftc.codegen.triton.tools.catalog import graph_kernel_choices
from ttftc.commands import UsageError, parse_passes
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend
from ttftc.models import ModelInputError


def run(args) -> int:
    try:
        device = None if args.device is None else get_device(args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        spec = resolve_model(args.model)
    except ModelInputError as exc:
        raise UsageError(str(exc)) from None
    limit = max_positions(model_config(spec))
    if limit is not None and args.seq > limit:
        raise UsageError(f"--seq {args.seq} does not fit the model's {limit} positions")
    passes = parse_passes(args.passes)
    try:
        config = Config(passes=passes, precision=args.precision, provider=args.provider)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    model = load_model(spec)
    ids = example_prompt(model.config.vocab_size, args.seq)
    if device is None:
        report, graphs = explain(model, ids, config=config, **PREFILL_KWARGS), []
    else:
        report, graphs = _explain_keeping_graphs(model, ids, config)
    print(f"{spec.name}, prefill of {args.seq} tokens (logits of the last token), {config}")
    print(report)
    flops = prefill_flops(describe_prefill(model), args.seq)
    print(f"roofline: {flops / 1e9:.3f} GFLOP per prefill (linear layers, causal attention, lm_head on one token)")
    if device is None:
        peak = measure_gemm_peak(args.precision, size=1024, repeats=3)
        if peak.gflops:
            print(f"roofline: {args.precision} GEMM peak measured now {peak.gflops:.0f} G/s "
                  f"({peak.op} {peak.size}^3) -> predicted TTFT >= {bound_ms(flops, peak):.2f} ms")
    else:
        _print_device_prediction(graphs, device)
    torch._dynamo.reset()
    return 0


def _explain_keeping_graphs(model, ids, config):
    """ttftc.explain, keeping the lowered graphs the prediction reads (ttftc.explain returns only the report)."""
    backend = TtftcBackend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids, **PREFILL_KWARGS)
    return backend.report(), backend.graph_modules


def _print_device_prediction(graphs, device: DeviceSpec) -> None:
    print(format_prediction(predict(graphs, device)))
    target = get_target(device.kernel_target)
    print(f"kernel configs on {target.name} ({target.device}), untuned; no kernel ran on this device "
          "(`ttftc kernels --target " + target.name + "` compiles them):")
    for op, count, choice in graph_kernel_choices(graphs, target):
        config = " ".join(f"{k}={v}" for k, v in choice.config.items())
        print(f"  ttftc.{op} x{count}: {choice.kernel} {config}".rstrip() + (f"  ({choice.detail})" if choice.detail
                                                                              else ""))
