"""The CPU defaults measured per machine (float GEMM backend, attention kernel) reach `explain` and the bench header,
with whether each was measured now or loaded, and when."""

from __future__ import annotations

import torch

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.bench import runner
from ttftc.codegen.cpu import attention
from ttftc.codegen.cpu._blas import measured_gemm_backend
from ttftc.codegen.cpu.int8_linear import int8_gemm_choice
from ttftc.codegen.cpu.measured import Provenance


def test_the_attention_choice_names_the_fastest_kernel_every_time_and_where_they_came_from(monkeypatch):
    loaded = Provenance(0.0, True, "/cache/machine/choices.json")
    monkeypatch.setattr(attention, "kernel_measurement",
                        lambda dtype: ({"flash": 0.0020, "gemm_blocks": 0.0031, "native": 0.0012}, loaded))
    assert attention.fastest_kernel(torch.float32) == "native"
    assert attention.describe_kernel_choice(torch.float32) == (
        "fp32 attention: native (1.2 ms; flash 2.0 ms; gemm_blocks 3.1 ms at 8 heads x 512 tokens x 64, causal; "
        "loaded from /cache/machine/choices.json, measured 1970-01-01 00:00 UTC)")
    monkeypatch.setattr(attention, "kernel_measurement",
                        lambda dtype: ({"flash": 0.0009, "gemm_blocks": 0.0031}, Provenance(0.0, False)))
    assert attention.describe_kernel_choice(torch.bfloat16) == (
        "bf16 attention: flash (0.9 ms; gemm_blocks 3.1 ms at 8 heads x 512 tokens x 64, causal; measured now, "
        "1970-01-01 00:00 UTC)")


@needs_transformers
def test_explain_notes_what_was_measured_for_the_ops_it_lowered():
    model = zoo.build("llama", "sdpa")
    report = ttftc.explain(model, zoo.example_ids(model, 9), config=ttftc.Config(precision="fp32"))
    assert measured_gemm_backend(torch.float32).describe() in report.notes
    assert attention.describe_kernel_choice(torch.float32) in report.notes
    assert not any(note.startswith("bf16 ") for note in report.notes)  # no bf16 value in an fp32 graph


@needs_transformers
def test_no_note_for_a_default_the_graph_does_not_use():
    model = zoo.build("llama", "sdpa")
    report = ttftc.explain(model, zoo.example_ids(model, 9), config=ttftc.Config(passes=("rope",), precision="fp32"))
    assert not any(note.startswith(("fp32 GEMM:", "fp32 attention:")) for note in report.notes)


def test_the_bench_header_lists_every_measured_choice():
    header = runner._capabilities("cpu")
    for choice in (int8_gemm_choice().describe(), measured_gemm_backend(torch.float32).describe(),
                   attention.describe_kernel_choice(torch.float32)):
        assert f"; {choice}" in header
