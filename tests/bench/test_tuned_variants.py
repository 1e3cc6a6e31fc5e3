"""`tuned=on|off` in the ttftc variant grammar: parsing, what each builds, and where tuned=on reads its configs."""

from __future__ import annotations

import pytest

from ttftc.bench.caches import fresh_cache_dirs
from ttftc.bench.errors import BenchInputError
from ttftc.bench.models import ModelSource, resolve_model
from ttftc.bench.runner import BenchSettings, _autotune_dir, plan
from ttftc.bench.variants import autotune_cache_for_variants, bench_autotune_dir, get_variant, split_variant_list
from ttftc.tuning.chunking import _ttftc_backend_of


@pytest.fixture(scope="module")
def source():
    return ModelSource(resolve_model("tiny"))


def backend_of(variant_name: str, source):
    prepared = get_variant(variant_name).build(source)
    backend = _ttftc_backend_of(prepared.model)
    assert backend is not None
    return backend


def test_grammar_accepts_tuned_on_and_off_and_refuses_anything_else():
    names = split_variant_list("ttftc[precision=fp32,tuned=off],ttftc[precision=bf16,tuned=on]")
    off, on = (get_variant(n) for n in names)
    assert "autotuned configs off" in off.description and off.dtype == "fp32"
    assert "autotuned configs on" in on.description and on.dtype == "bf16"
    with pytest.raises(BenchInputError, match="tuned must be on or off"):
        get_variant("ttftc[precision=fp32,tuned=maybe]")


def test_tuned_off_compiles_with_autotune_disabled(source):
    backend = backend_of("ttftc[precision=fp32,tuned=off]", source)
    assert backend.config.autotune is False and backend.autotune_cache is None


def test_tuned_on_reads_the_directory_the_bench_hands_over(source, tmp_path):
    with autotune_cache_for_variants(str(tmp_path)):
        backend = backend_of("ttftc[precision=fp32,tuned=on]", source)
    assert backend.config.autotune is True
    assert backend.autotune_cache.directory == tmp_path


def test_without_tuned_the_variant_is_unchanged(source):
    backend = backend_of("ttftc[precision=fp32]", source)
    assert backend.config.autotune is True and backend.autotune_cache is None


def test_default_autotune_dir_is_resolved_before_the_bench_moves_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.delenv("TTFTC_AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("TTFTC_CACHE_DIR", str(tmp_path))
    settings = BenchSettings(model="tiny", variants=("ttftc[precision=fp32,tuned=on]",))
    resolved = _autotune_dir(settings)
    assert resolved == str(tmp_path / "autotune")
    with fresh_cache_dirs(), autotune_cache_for_variants(resolved):
        assert bench_autotune_dir() == resolved
    explicit = BenchSettings(model="tiny", variants=("ttftc[tuned=on]",), autotune_cache=str(tmp_path))
    assert _autotune_dir(explicit) == str(tmp_path)


def test_a_missing_autotune_cache_directory_is_a_clear_error(tmp_path):
    settings = BenchSettings(model="tiny", variants=("ttftc[precision=fp32,tuned=on]",),
                             autotune_cache=str(tmp_path / "missing"))
    with pytest.raises(BenchInputError, match="--autotune-cache .* is not a directory"):
        plan(settings)
