"""`ttftc serve`'s scheduler flags reach ttftc.LLM (the server itself is tested in tests/serve)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import ttftc.llm
import ttftc.serve
from ttftc.cli import main


@pytest.fixture
def llm_calls(monkeypatch):
    calls = []

    def fake_llm(*args, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(name="tiny", notes=[])

    monkeypatch.setattr(ttftc.llm, "LLM", fake_llm)
    monkeypatch.setattr(ttftc.serve, "create_app", lambda llm, **kwargs: "app")
    monkeypatch.setattr(ttftc.serve, "run_server", lambda app, **kwargs: 0)
    return calls


@pytest.mark.parametrize("flags, yield_chunk", [([], None), (["--yield-chunk", "16"], 16)])
def test_yield_chunk_reaches_the_scheduler_settings(llm_calls, flags, yield_chunk):
    assert main(["serve", "tiny", "--compile-before-ready", *flags]) == 0
    assert [call["yield_chunk"] for call in llm_calls] == [yield_chunk]


def test_a_yield_chunk_that_is_not_a_positive_number_is_refused(llm_calls, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "tiny", "--yield-chunk", "0"])
    assert exit_info.value.code == 2
    assert "--yield-chunk" in capsys.readouterr().err and not llm_calls
