"""Config.autotune: the switch between tuned and default kernel configs is part of the Config and its digest."""

import pytest

import ttftc


def test_autotune_defaults_on_and_joins_the_digest():
    base = ttftc.Config()
    assert base.autotune is True
    assert base.replace(autotune=False).digest() != base.digest()


@pytest.mark.parametrize("value", ["off", 0, None])
def test_autotune_must_be_a_bool(value):
    with pytest.raises(ValueError, match="Config.autotune must be True or False"):
        ttftc.Config(autotune=value)
