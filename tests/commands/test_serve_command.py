"""`ttftc serve`'s scheduler flags reach ttftc.LLM (the server itself is tested in tests/serve)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import ttftc.llm
import ttftc.serve
from ttftc.cli import main
from ttftc.serve.policy import PriorityRange


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


def test_tenant_priority_ranges_and_a_priority_file_reach_the_policy(tmp_path, monkeypatch):
    """Issue 40: NAME=BEST..WORST, NAME=BEST (to the largest), and a priority file's default and tenants."""
    seen = {}
    monkeypatch.setattr(ttftc.llm, "LLM", lambda *a, **k: SimpleNamespace(notes=[], name="tiny",
                                                                               close=lambda **_: None))
    monkeypatch.setattr(ttftc.serve, "create_app", lambda llm, **k: seen.update(k) or "app")
    monkeypatch.setattr(ttftc.serve, "run_server", lambda *a, **k: 0)
    path = tmp_path / "p.json"
    path.write_text('{"default": [0, 50], "tenants": {"ops": [-9, 3]}}')
    assert main(["serve", "tiny", "--tenant-header", "X-T", "--tenant-priority", "batch=5..9",
                 "--tenant-priority", "vip=-2", "--priority-file", str(path)]) == 0
    policy = seen["policy"]
    assert policy.tenant_priorities == {"batch": PriorityRange(5, 9), "vip": PriorityRange(-2),
                                        "ops": PriorityRange(-9, 3)}
    assert policy.default_priorities == PriorityRange(0, 50)
    for flags in (["--tenant-priority", "a=5..1"], ["--tenant-priority", "a=1..x"]):
        with pytest.raises(SystemExit):
            main(["serve", "tiny", "--tenant-header", "X-T", *flags])
    path.write_text('{"default": [-1, 50]}')
    assert main(["serve", "tiny", "--priority-file", str(path)]) == 2
