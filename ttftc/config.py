"""The one configuration object of ttftc: frozen, validated, hashable.

Its `digest()` joins every cache key (compile cache, AOT artifacts, autotune), so any field that changes the
generated code must live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal, Union

PRECISIONS = ("auto", "fp32", "bf16", "int8")
DEVICES = ("auto", "cpu", "cuda", "npu")
PROVIDERS = ("auto", "reference", "triton", "cpu", "npu")
OVERSIZE_POLICIES = ("error", "dynamic")
CODEGENS = ("eager", "inductor")
DYNAMIC_SHAPES = ("auto", "dynamo")
REGIONS = ("off", "blocks")
# The names Config.passes may give, in pipeline order. The passes themselves sit above the config
# (ttftc/passes/registry.py, whose PIPELINE is checked against this tuple when it is imported), so that a Config
# is validated when it is built without importing a single pass.
PASS_NAMES = ("attention", "rope", "ffn", "norm_linear", "precision", "linear", "kv_inplace")

Precision = Literal["auto", "fp32", "bf16", "int8"]


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


@dataclass(frozen=True)
class Config:
    """What to compile and how.

    passes:     "all", or a tuple of pass names to run (in pipeline order, whatever order they are given in).
    precision:  "auto" runs GEMMs and attention in bf16 where the device computes bf16 natively (ttftc.capabilities)
                and keeps fp32 elsewhere; it never quantises. "fp32" keeps the model's numerics; "bf16" runs
                GEMMs and attention in bf16 wherever asked; "int8" is W8A8 (the rest as "auto").
    buckets:    prompt-length buckets for padding (None: no bucketing, shapes stay as Dynamo gives them); eager
                codegen only.
    device:     "auto" follows the example inputs.
    provider:   "auto" picks the first capable lowering per op; any other value forces that provider wherever
                it is capable and uses the torch reference elsewhere.
    quant_skip: module-name fragments kept out of int8 (the lm_head by default: logits quality).
    on_oversize: a prompt longer than the largest bucket either raises ("error") or runs unpadded ("dynamic").
    autotune:   lowerings use the configs `ttftc autotune` stored in the autotune cache (True), or always their
                defaults (False: what `ttftc bench` compares tuned against).
    codegen:    "eager" runs the post-pass graph op by op (fast compile, no C++ toolchain, AOT artifacts);
                "inductor" runs the same passes inside Inductor, which generates fused code for the glue between
                ttftc ops (C++ on CPU, Triton on GPU) and calls each ttftc op's lowering as an extern kernel.
    regions:    "blocks" compiles each distinct repeated block of the graph (a decoder layer: a ModuleList entry)
                once and reuses its compiled code for every block of the same structure, with that block's own
                weights (ttftc/regions/), so the passes and the lowering do not grow with the model's depth. "off"
                compiles the graph whole. Eager codegen without buckets only, for now.
    """

    passes: Union[str, tuple[str, ...]] = "all"
    precision: Precision = "auto"
    buckets: tuple[int, ...] | None = None
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    provider: Literal["auto", "reference", "triton", "cpu", "npu"] = "auto"
    quant_skip: tuple[str, ...] = ("lm_head",)
    on_oversize: Literal["error", "dynamic"] = "error"
    autotune: bool = True
    codegen: Literal["eager", "inductor"] = "eager"
    dynamic_shapes: Literal["auto", "dynamo"] = "auto"
    regions: Literal["off", "blocks"] = "off"

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and normalised to tuples so the Config stays hashable.
        if isinstance(self.passes, list):
            object.__setattr__(self, "passes", tuple(self.passes))
        if isinstance(self.buckets, list):
            object.__setattr__(self, "buckets", tuple(self.buckets))
        if isinstance(self.quant_skip, list):
            object.__setattr__(self, "quant_skip", tuple(self.quant_skip))
        self._validate()

    def _validate(self) -> None:
        known = PASS_NAMES
        if isinstance(self.passes, str):
            if self.passes != "all":
                raise ValueError(
                    f"Config.passes={self.passes!r} is not valid: use 'all' or a tuple of pass names "
                    f"from {_choices(known)}."
                )
        elif isinstance(self.passes, tuple):
            for name in self.passes:
                if name not in known:
                    raise ValueError(f"Unknown pass {name!r} in Config.passes; valid passes: {_choices(known)}.")
        else:
            raise ValueError(f"Config.passes must be 'all' or a tuple of pass names, got {self.passes!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r}; valid precisions: {_choices(PRECISIONS)}.")
        if self.device not in DEVICES:
            raise ValueError(f"Unknown device {self.device!r}; valid devices: {_choices(DEVICES)}.")
        if self.provider not in PROVIDERS:
            raise ValueError(f"Unknown provider {self.provider!r}; valid providers: {_choices(PROVIDERS)}.")
        if self.on_oversize not in OVERSIZE_POLICIES:
            raise ValueError(
                f"Unknown on_oversize {self.on_oversize!r}; valid values: {_choices(OVERSIZE_POLICIES)}."
            )
        if self.codegen not in CODEGENS:
            raise ValueError(f"Unknown codegen {self.codegen!r}; valid code generators: {_choices(CODEGENS)}.")
        if self.dynamic_shapes not in DYNAMIC_SHAPES:
            raise ValueError(
                f"Unknown dynamic_shapes {self.dynamic_shapes!r}; valid values: {_choices(DYNAMIC_SHAPES)}."
            )
        if self.regions not in REGIONS:
            raise ValueError(f"Unknown regions {self.regions!r}; valid values: {_choices(REGIONS)}.")
        if self.regions != "off" and (self.codegen != "eager" or self.buckets is not None):
            raise ValueError(
                f"Config.regions={self.regions!r} needs codegen='eager' and buckets=None (regional compilation "
                "rewrites the eager code generator's graph; Inductor and bucket capture compile graphs whole). "
                "Use regions='off' with them."
            )
        if not isinstance(self.autotune, bool):
            raise ValueError(f"Config.autotune must be True or False, got {self.autotune!r}.")
        if not isinstance(self.quant_skip, tuple) or not all(isinstance(s, str) for s in self.quant_skip):
            raise ValueError(f"Config.quant_skip must be a tuple of strings, got {self.quant_skip!r}.")
        if self.buckets is not None:
            buckets = self.buckets
            if not isinstance(buckets, tuple) or not buckets:
                raise ValueError(
                    f"Config.buckets={buckets!r} is not valid: use None or a non-empty tuple of positive ints, "
                    "e.g. (128, 256, 512)."
                )
            for b in buckets:
                if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                    raise ValueError(
                        f"Bucket {b!r} in Config.buckets is not a positive int; use e.g. (128, 256, 512)."
                    )
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(
                    f"Config.buckets={buckets!r} must be strictly increasing with no duplicates, "
                    f"e.g. {tuple(sorted(set(buckets)))!r}."
                )
            if self.codegen == "inductor":
                # Each bucket's graph is captured and stored as an eager program (ttftc/buckets/capture.py), the
                # form the compile cache and AOT artifacts hold; Inductor never sees it.
                raise ValueError(
                    f"Config.buckets={buckets!r} cannot be combined with codegen='inductor': bucket graphs run on "
                    "the eager code generator. Use codegen='eager' to keep the buckets, or buckets=None to let "
                    "Inductor compile one graph with a symbolic prompt length (no recompile per length either)."
                )

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        payload = json.dumps(self.to_dict(), sort_keys=True, default=list)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
