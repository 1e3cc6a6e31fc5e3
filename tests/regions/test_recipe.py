"""Weight recipes (ttftc/regions/recipe.py): what a compile derives from weights, replayed on other weights."""

import pytest
import torch

from ttftc.regions.recipe import ReplayMismatch, WeightRecorder, recipe_for


def _derive(ws):
    """The kinds of weight transforms passes make: concatenate, cast, pad into a fresh buffer, quantise."""
    a, b, c = ws
    qkv = torch.cat([a, b]).detach()
    cast = c.to(torch.bfloat16)
    padded = torch.zeros(6, 4)
    padded[:4, :] = a
    scale = a.abs().amax(dim=1, keepdim=True) / 127
    q = torch.clamp(torch.round(a / scale), -127, 127).to(torch.int8)
    return {"qkv": qkv, "cast": cast, "padded": padded, "q": q, "scale": scale}


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(3, 3, generator=g)]


def _record(fn, ws):
    with WeightRecorder(ws) as recorder:
        out = fn(ws)
    return recorder, out


def test_replay_on_other_weights_gives_what_deriving_from_them_gives():
    recorder, buffers = _record(_derive, _weights(0))
    recipe, why = recipe_for(recorder, buffers, lambda t: False)
    assert why is None
    other = _weights(1)
    replayed, direct = recipe.replay(other), _derive(other)
    assert set(replayed) == set(direct)
    for name in direct:
        assert torch.equal(replayed[name], direct[name]), name
    assert not torch.equal(replayed["qkv"], buffers["qkv"])  # really the other weights


def test_a_value_read_is_checked_again_on_replay():
    def derive(ws):
        w = ws[0]
        if bool((w.abs() < 10).all()):  # a decision on the values, as a pass's NaN/inf refusal is
            return {"w": w.t().contiguous()}
        return {"w": w}

    recorder, buffers = _record(derive, _weights(0))
    recipe, why = recipe_for(recorder, buffers, lambda t: False)
    assert why is None and recorder.reads == 1
    assert torch.equal(recipe.replay(_weights(1))["w"], _weights(1)[0].t())  # same decision: replayed
    big = _weights(1)
    big[0][0, 0] = 100.0
    with pytest.raises(ReplayMismatch):  # the read differs: the compile's decision may too
        recipe.replay(big)


def test_a_read_into_an_opaque_value_makes_the_recording_unsafe():
    recorder, _ = _record(lambda ws: ws[0].numpy(), _weights(0))  # a value no replay can compare
    assert recorder.unsafe is not None and "numpy" in recorder.unsafe
    assert recipe_for(recorder, {}, lambda t: False)[0] is None


def test_writing_into_a_source_weight_makes_the_recording_unsafe():
    recorder, _ = _record(lambda ws: ws[0].detach().mul_(2), _weights(0))
    assert recorder.unsafe is not None and "wrote into a source weight" in recorder.unsafe


def test_a_buffer_of_unseen_origin_has_no_recipe():
    ws = _weights(0)
    outside = torch.randn(3)  # made before recording: the recorder cannot say it does not depend on the weights
    recorder, buffers = _record(lambda w: {"kept": w[0].t(), "foreign": outside}, ws)
    recipe, why = recipe_for(recorder, buffers, lambda t: False)
    assert recipe is None and "foreign" in why


def test_weights_of_another_shape_do_not_match():
    recorder, buffers = _record(_derive, _weights(0))
    recipe, _ = recipe_for(recorder, buffers, lambda t: False)
    other = _weights(1)
    other[0] = torch.randn(5, 4)
    assert recipe.matches(other) is not None
    assert recipe.matches(_weights(2)) is None
