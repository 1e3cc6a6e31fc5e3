"""The ablation: ttftc's passes switched on one at a time, in pipeline order.

Steps: a baseline with no pass, then each registered pass added to the previous step, in the order of
`ttftc.passes.registry.pass_names()`, all in fp32; the `precision` pass comes last whatever its place in the
pipeline, as the step that also sets precision="bf16" (in fp32 that pass has nothing to do). Keeping it last
means every fp32 step is compared with an fp32 step, and the fp32 steps' last one is ttftc's whole fp32 pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttftc.bench.variants import ttftc_spec
from ttftc.passes.registry import pass_names

ABLATION_PRECISION = "bf16"


@dataclass(frozen=True)
class AblationStep:
    label: str  # "baseline", "+attention", ...
    variant: str  # the ttftc[...] variant name it runs as


def ablation_steps() -> list[AblationStep]:
    steps = [AblationStep("baseline", ttftc_spec(()))]
    enabled: list[str] = []
    for name in pass_names():
        if name != "precision":
            enabled.append(name)
            steps.append(AblationStep(f"+{name}", ttftc_spec(tuple(enabled))))
    if "precision" in pass_names():
        enabled.append("precision")
        steps.append(AblationStep(f"+precision({ABLATION_PRECISION})", ttftc_spec(tuple(enabled), ABLATION_PRECISION)))
    return steps
