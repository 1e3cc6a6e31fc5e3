"""One clean tiny artifact per session, built once and copied by each test that attacks it."""

import pytest
import torch

import ttftc
from tests.helpers import HAS_TRANSFORMERS
from tests.security.attack import Outside, copy_artifact
from ttftc.aot import build_artifact

BUCKETS = (16, 32)
PROMPT = torch.arange(3, 14).unsqueeze(0)  # 11 tokens: bucket 16


@pytest.fixture(scope="session")
def clean_artifact(tmp_path_factory):
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    directory = tmp_path_factory.mktemp("security") / "clean"
    build_artifact("tiny", directory, ttftc.Config(buckets=BUCKETS), logits=("last",), cache=None)
    return directory


@pytest.fixture(scope="session")
def clean_logits(clean_artifact):
    return ttftc.load(clean_artifact)(PROMPT, logits_to_keep=1).logits


@pytest.fixture
def artifact(clean_artifact, tmp_path):
    """A private copy of the clean artifact, for one test to attack."""
    return copy_artifact(clean_artifact, tmp_path / "artifact")


@pytest.fixture
def outside(tmp_path):
    return Outside(tmp_path / "outside")
