"""The ablation: ttftc's passes switched on one at a time, in pipeline order.

Steps: a baseline with no pass, then each registered pass added to the previous step, in the order of
`ttftc.passes.registry.pass_names()`. The step that adds the `precision` pass also sets precision="bf16"
(in fp32 that pass has nothing to do). Passes that are not registered (yet) have no step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttftc.bench.variants import ttftc_spec

ABLATION_PRECISION = "bf16"


@dataclass(frozen=True)
class AblationStep:
    label: str  # "baseline", "+attention", ...
    variant: str  # the ttftc[...] variant name it runs as


def ablation_steps() -> list[AblationStep]:
    from ttftc.passes.registry import pass_names

    steps = [AblationStep("baseline", ttftc_spec(()))]
    enabled: list[str] = []
    for name in pass_names():
        enabled.append(name)
        if name == "precision":
            steps.append(AblationStep(f"+precision({ABLATION_PRECISION})", ttftc_spec(tuple(enabled), ABLATION_PRECISION)))
        else:
            steps.append(AblationStep(f"+{name}", ttftc_spec(tuple(enabled))))
    return steps
