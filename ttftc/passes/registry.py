"""Which passes exist, in pipeline order: PIPELINE is the one place that makes a class a pass and decides when it
runs. A module in ttftc/passes/ is a pass because it is listed here, not because of its file name."""

from __future__ import annotations

from ttftc.config import PASS_NAMES, Config
from ttftc.passes.attention import AttentionPass
from ttftc.passes.ffn import FfnPass
from ttftc.passes.kv_inplace import KvInplacePass
from ttftc.passes.linear import LinearPass
from ttftc.passes.norm_linear import NormLinearPass
from ttftc.passes.precision import PrecisionPass
from ttftc.passes.rope import RopePass

# The order the passes build on each other in: rope after attention (the attention op's q and k become its
# outputs either way); norm_linear after ffn (a norm feeding a gated_ffn becomes ttftc.norm); the precision policy
# over the fused ops and the plain GEMMs; linear after them, so it only sees the linears no fusion took; kv_inplace
# last, so that no pass after it moves a read of a KV buffer across the in-place write it makes.
PIPELINE: tuple[type, ...] = (AttentionPass, RopePass, FfnPass, NormLinearPass, PrecisionPass, LinearPass,
                              KvInplacePass)


def _check(pipeline: tuple[type, ...]) -> None:
    names = [cls.name for cls in pipeline]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"two passes share the name {duplicates[0]!r}")
    if tuple(names) != PASS_NAMES:
        raise ValueError(f"the pipeline's pass names {tuple(names)!r} differ from ttftc.config.PASS_NAMES "
                         f"{PASS_NAMES!r}, which validates Config.passes: keep the two in the same order")


_check(PIPELINE)


def pass_classes() -> list[type]:
    return list(PIPELINE)


def pass_names() -> tuple[str, ...]:
    return tuple(cls.name for cls in PIPELINE)


def enabled_passes(config: Config) -> tuple[str, ...]:
    """The passes `config` runs, in pipeline order whatever order Config.passes gives them in."""
    if config.passes == "all":
        return pass_names()
    return tuple(n for n in pass_names() if n in config.passes)
