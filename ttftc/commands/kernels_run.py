"""`ttftc kernels` run: what the parsed arguments of ttftc/commands/kernels.py do."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from ttftc.codegen.triton.targets import get_target
from ttftc.codegen.triton.tools import kernel_check
from ttftc.codegen.triton.tools.ascend_lowering import AscendToolchainError
from ttftc.codegen.triton.tools.catalog import OP_KERNELS
from ttftc.commands import UsageError


def _kb(value) -> str:
    return "-" if value is None else f"{value / 1024:.1f}"


def _config(config: dict) -> str:
    return " ".join(f"{k}={'T' if v is True else 'F' if v is False else v}" for k, v in config.items())


def format_row(row, target) -> str:
    c = row.case
    status = "ok" if row.passed else "FAIL"
    if target.backend == "npu":
        resources = f"UB {_kb(row.ub_bytes):>6} KB"
    else:
        sgpr = f" sgpr-spill {row.sgpr_spills}" if row.sgpr_spills else ""
        resources = (f"smem {_kb(row.shared_bytes):>6} KB  regs {row.registers if row.registers is not None else '-':>3}"
                     f"  spill {row.spill_bytes if row.spill_bytes is not None else '-':>5} B{sgpr}")
    line = (f"{row.target:<12}{row.kernel:<28}{c['dtype']:<6}{c['shape']:<24}{c['variant']:<22}"
            f"{'*' if c['default'] else ' '} {_config(c['config']):<58}{status:<5} {resources}")
    for failure in row.failures:
        line += f"\n    -> {failure}"
    return line


def run(args) -> int:
    try:
        targets = [get_target(name) for name in args.target]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    unknown = sorted(set(args.ops or ()) - set(OP_KERNELS))
    if unknown:
        raise UsageError(f"unknown op(s) {', '.join(unknown)} in --ops: expected some of {', '.join(OP_KERNELS)}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json}: its directory does not exist; create it or name another file")
    print(f"{'target':<12}{'kernel':<28}{'dtype':<6}{'shape':<24}{'variant':<22}* = default config")
    rows = []
    for target in targets:
        if target.backend == "npu":
            try:
                checked = kernel_check.check_ascend(target, ops=args.ops, defaults_only=args.defaults_only,
                                                    build_venv=args.build_ascend_venv)
            except AscendToolchainError as exc:
                raise UsageError(str(exc)) from None
            for row in checked:
                print(format_row(row, target), flush=True)
        else:
            def show(row, target=target):
                print(format_row(row, target), flush=True)

            checked = kernel_check.check_gpu(target, ops=args.ops, defaults_only=args.defaults_only, jobs=args.jobs,
                                             progress=show)
        rows.extend(checked)
    failed = [r for r in rows if not r.passed]
    for target in targets:
        mine = [r for r in rows if r.target == target.name]
        bad = sum(not r.passed for r in mine)
        print(f"{target.name} ({target.device}): {len(mine) - bad}/{len(mine)} configs pass")
    if args.json:
        payload = {"targets": {t.name: asdict(t) for t in targets}, "results": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 1 if failed else 0
