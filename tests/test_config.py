import pytest

import ttftc
from ttftc.config import DEVICES, PASS_NAMES, PRECISIONS, PROVIDERS
from ttftc.passes.registry import enabled_passes, pass_names


def test_default_config_is_frozen_and_hashable():
    cfg = ttftc.Config()
    assert hash(cfg) == hash(ttftc.Config())
    assert cfg.digest() == ttftc.Config().digest()
    with pytest.raises(Exception):
        cfg.precision = "bf16"  # type: ignore[misc]


def test_digest_changes_with_every_field():
    base = ttftc.Config()
    variants = [
        base.replace(precision="bf16"),
        base.replace(regions="blocks"),
        base.replace(buckets=(128, 256)),
        base.replace(device="cpu"),
        base.replace(provider="reference"),
        base.replace(passes=()),
        base.replace(quant_skip=()),
        base.replace(on_oversize="dynamic"),
        base.replace(autotune=False),
        base.replace(codegen="inductor"),
        base.replace(dynamic_shapes="dynamo"),
    ]
    digests = {v.digest() for v in variants} | {base.digest()}
    assert len(digests) == len(variants) + 1
    import dataclasses

    changed = {f.name for v in variants for f in dataclasses.fields(v) if getattr(v, f.name) != getattr(base, f.name)}
    assert changed == {f.name for f in dataclasses.fields(base)}, "a Config field is missing from this test"


def test_lists_are_normalised_to_tuples():
    cfg = ttftc.Config(passes=[], buckets=[16, 32])
    assert cfg.passes == () and cfg.buckets == (16, 32)
    hash(cfg)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(precision="fp8"), ["'fp8'", *PRECISIONS]),
        (dict(device="tpu"), ["'tpu'", *DEVICES]),
        (dict(provider="cutlass"), ["'cutlass'", *PROVIDERS]),
        (dict(passes=("no_such_pass",)), ["'no_such_pass'", "valid passes"]),
        (dict(passes="some"), ["'some'", "'all'"]),
        (dict(buckets=(256, 128)), ["(256, 128)", "increasing"]),
        (dict(buckets=(0, 128)), ["0", "positive"]),
        (dict(buckets=()), ["()", "non-empty"]),
        (dict(buckets=(16, "32")), ["'32'", "positive int"]),
        (dict(on_oversize="pad"), ["'pad'", "'error'", "'dynamic'"]),
        (dict(buckets=(16, 32), codegen="inductor"),
         ["(16, 32)", "codegen='inductor'", "codegen='eager'", "buckets=None"]),
    ],
)
def test_invalid_values_name_the_value_and_the_valid_ones(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        ttftc.Config(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_enabled_passes_follow_pipeline_order():
    names = pass_names()
    assert names == PASS_NAMES
    cfg = ttftc.Config(passes=tuple(reversed(names)))
    assert enabled_passes(cfg) == names
    assert enabled_passes(ttftc.Config(passes=())) == ()
