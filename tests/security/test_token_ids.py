"""Issue item 8: token ids are checked against the vocabulary before they reach a graph, in the bucketed runner and
in a loaded artifact (whose manifest records the vocabulary size)."""

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from tests.security.attack import read_json
from tests.security.conftest import PROMPT
from ttftc import zoo
from ttftc.bucketed import compile_bucketed

pytestmark = needs_transformers


@pytest.mark.parametrize("bad", [-1, 512, 2**40])
def test_a_loaded_artifact_names_the_bad_id_and_the_range(clean_artifact, bad):
    assert read_json(clean_artifact / "manifest.json")["vocab_size"] == 512
    model = ttftc.load(clean_artifact)
    ids = PROMPT.clone()
    ids[0, 4] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} \(batch row 0, position 4\) is outside the vocabulary "
                                         r"\[0, 512\)"):
        model(ids, logits_to_keep=1)


def test_padding_slots_are_not_checked(clean_artifact, clean_logits):
    """Only real tokens reach the embedding; a caller's padding value is replaced before the graph runs."""
    model = ttftc.load(clean_artifact)
    padded = torch.cat([torch.full((1, 3), -100), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    out = model(padded, attention_mask=mask, logits_to_keep=1)
    torch.testing.assert_close(out.logits, clean_logits)


def test_the_bucketed_runner_checks_before_it_compiles(monkeypatch):
    model = zoo.build("llama")
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=None)

    def no_compile(*args, **kwargs):
        raise AssertionError("an out-of-vocabulary prompt reached the compiler")

    monkeypatch.setattr(bucketed.source, "get", no_compile)
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"token id {vocab} .* outside the vocabulary \[0, {vocab}\)"):
        bucketed(torch.tensor([[1, 2, vocab]]))
    with pytest.raises(ValueError, match=r"token id -5 \(batch row 1, position 0\)"):
        bucketed(torch.tensor([[1, 2, 3], [-5, 2, 3]]))
