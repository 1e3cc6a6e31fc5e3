"""`ttftc explain MODEL`: what every ttftc pass did to MODEL's prefill graph at one prompt length."""

from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"malformed --seq {text!r}: expected one positive integer")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "explain",
        help="print ttftc's pass matches, rejections, op counts and lowering for a model's prefill",
        description="Compile MODEL's prefill (batch 1, logits of the last token) with ttftc at one prompt "
        "length and print the explain table. MODEL is a preset or a local Hugging Face model directory.",
    )
    p.add_argument("model", metavar="MODEL", help="preset name or local model directory")
    p.add_argument("--seq", type=_positive, default=128, help="prompt length (default 128)")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32")
    p.add_argument("--passes", default="all", help="all (default), none, or pass names separated by commas")
    p.add_argument("--provider", choices=("auto", "reference", "triton", "cpu", "npu"), default="auto")
    p.add_argument("--device", type=_device, default=None, metavar="a100|h100|mi300x|910b",
                   help="predict TTFT on this accelerator from the graph's FLOPs and bytes and its published peaks "
                   "(ttftc/bench/devices.json), with per-op bounds and the kernel configs its target would get")
    p.set_defaults(run=run)


def _device(text: str) -> str:
    # Read the table only when --device is given: `ttftc --help` must not import the bench package.
    from ttftc.bench.devices import get_device

    try:
        return get_device(text).key
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args) -> int:
    import torch

    import ttftc
    from ttftc.models import ModelInputError
    from ttftc.bench.models import PREFILL_KWARGS, example_prompt, load_model, max_positions, model_config, resolve_model
    from ttftc.bench.roofline import bound_ms, describe_prefill, measure_gemm_peak, prefill_flops
    from ttftc.commands import UsageError, parse_passes

    try:
        spec = resolve_model(args.model)
    except ModelInputError as exc:
        raise UsageError(str(exc)) from None
    limit = max_positions(model_config(spec))
    if limit is not None and args.seq > limit:
        raise UsageError(f"--seq {args.seq} does not fit the model's {limit} positions")
    passes = parse_passes(args.passes)
    try:
        config = ttftc.Config(passes=passes, precision=args.precision, provider=args.provider)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    model = load_model(spec)
    ids = example_prompt(model.config.vocab_size, args.seq)
    if args.device is None:
        report, graphs = ttftc.explain(model, ids, config=config, **PREFILL_KWARGS), []
    else:
        report, graphs = _explain_keeping_graphs(model, ids, config)
    print(f"{spec.name}, prefill of {args.seq} tokens (logits of the last token), {config}")
    print(report)
    flops = prefill_flops(describe_prefill(model), args.seq)
    print(f"roofline: {flops / 1e9:.3f} GFLOP per prefill (linear layers, causal attention, lm_head on one token)")
    if args.device is None:
        peak = measure_gemm_peak(args.precision, size=1024, repeats=3)
        if peak.gflops:
            print(f"roofline: {args.precision} GEMM peak measured now {peak.gflops:.0f} G/s "
                  f"({peak.op} {peak.size}^3) -> predicted TTFT >= {bound_ms(flops, peak):.2f} ms")
    else:
        _print_device_prediction(graphs, args.device)
    torch._dynamo.reset()
    return 0


def _explain_keeping_graphs(model, ids, config):
    """ttftc.explain, keeping the lowered graphs the prediction reads (ttftc.explain returns only the report)."""
    import torch

    from ttftc.bench.models import PREFILL_KWARGS
    from ttftc.dynamo_backend import TtftcBackend

    backend = TtftcBackend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids, **PREFILL_KWARGS)
    return backend.report(), backend.graph_modules


def _print_device_prediction(graphs, device_key: str) -> None:
    from ttftc.bench.devices import get_device
    from ttftc.bench.prediction import format_prediction, predict
    from ttftc.codegen.triton.tools.catalog import graph_kernel_choices
    from ttftc.codegen.triton.targets import get_target

    device = get_device(device_key)
    print(format_prediction(predict(graphs, device)))
    target = get_target(device.kernel_target)
    print(f"kernel configs on {target.name} ({target.device}), untuned; no kernel ran on this device "
          "(`ttftc kernels --target " + target.name + "` compiles them):")
    for op, count, choice in graph_kernel_choices(graphs, target):
        config = " ".join(f"{k}={v}" for k, v in choice.config.items())
        print(f"  ttftc.{op} x{count}: {choice.kernel} {config}".rstrip() + (f"  ({choice.detail})" if choice.detail
                                                                              else ""))
