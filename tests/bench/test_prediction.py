"""The device table (published peaks with sources) and the roofline TTFT prediction from a graph."""

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ttftc.bench import devices as devices_module
from ttftc.bench.devices import all_devices, get_device
from ttftc.bench.prediction import format_prediction, predict


def test_the_five_devices_and_their_dense_peaks():
    assert set(all_devices()) == {"a100", "h100", "h200", "mi300x", "910b"}
    h100 = get_device("h100")
    assert h100.peak_tflops["bf16"] == 989.5 and h100.bandwidth_gb_s == 3350.0
    # The H200 is an H100's compute with more, faster memory.
    assert get_device("h200").peak_tflops == h100.peak_tflops and get_device("h200").bandwidth_gb_s == 4800.0
    assert get_device("a100").peak_tflops["bf16"] == 312.0
    assert get_device("mi300x").bandwidth_gb_s == 5300.0
    for d in all_devices().values():
        assert d.source.strip()
    assert get_device("910b").approximate and not h100.approximate


def test_a_missing_peak_is_stood_in_for_and_said():
    peak, note = get_device("910b").peak_flops("fp32")
    assert peak == 280e12 and "no published fp32 peak" in note
    assert get_device("h100").peak_flops("fp32") == (67e12, None)


def test_unknown_device_names_the_known_ones():
    with pytest.raises(ValueError, match="a100, h100, h200, mi300x, 910b"):
        get_device("v100")


@pytest.mark.parametrize("reported,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("AMD Instinct MI300X", "mi300x"),
    # boards with lower peaks than the SXM parts the table lists, and GPUs it does not list
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("Tesla V100-SXM2-16GB", None), ("NVIDIA H1000", None),
])
def test_a_gpu_is_found_by_the_name_torch_reports(reported, key):
    spec = devices_module.device_for_name(reported)
    assert (spec.key if spec else None) == key


def test_malformed_device_data_is_refused(monkeypatch, tmp_path):
    entry = dict(json.loads(devices_module._DATA.read_text())["devices"]["h100"], bandwidth_gb_s=-1)
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": {"bad": entry}}))
    monkeypatch.setattr(devices_module, "_DATA", path)
    devices_module.all_devices.cache_clear()
    try:
        with pytest.raises(ValueError, match="bandwidth_gb_s"):
            all_devices()
    finally:
        monkeypatch.undo()
        devices_module.all_devices.cache_clear()


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def test_a_gemm_is_bounded_by_flops_and_bytes():
    m, k, n = 256, 512, 1024
    gm = _graph(lambda a, b: torch.mm(a, b).view(-1), torch.randn(m, k), torch.randn(k, n))
    device = get_device("h100")
    prediction = predict([gm], device)
    (node,) = [b for b in prediction.nodes]  # the view moves nothing and is not a node of the prediction
    assert node.op == "aten.mm" and node.dtype == "fp32"
    assert node.flops == 2 * m * k * n
    assert node.bytes == 4 * (m * k + k * n + m * n)
    assert node.compute_s == pytest.approx(2 * m * k * n / 67e12)
    assert node.memory_s == pytest.approx(node.bytes / 3350e9)
    assert prediction.ttft_s == pytest.approx(max(node.compute_s, node.memory_s))


def test_dtype_selects_the_peak_and_elementwise_ops_are_memory_bound():
    gm = _graph(lambda a, b: torch.relu(torch.mm(a, b)), torch.randn(64, 64, dtype=torch.bfloat16),
                torch.randn(64, 64, dtype=torch.bfloat16))
    prediction = predict([gm], get_device("a100"))
    mm, relu = prediction.nodes
    assert mm.dtype == "bf16" and mm.compute_s == pytest.approx(2 * 64 ** 3 / 312e12)
    assert relu.flops == 0 and relu.bound_s == relu.memory_s > 0
    summary = {s.op: s for s in prediction.by_op()}
    assert summary["aten.relu"].compute_bound == 0


def test_an_embedding_reads_only_the_rows_it_returns():
    table = torch.randn(1000, 64)
    ids = torch.tensor([[1, 2, 3]])
    gm = _graph(lambda w, i: torch.nn.functional.embedding(i, w), table, ids)
    (node,) = predict([gm], get_device("h100")).nodes
    assert node.bytes == ids.numel() * 8 + 2 * 3 * 64 * 4


def test_the_formatted_prediction_names_the_source_and_the_bound():
    gm = _graph(lambda a, b: torch.mm(a, b), torch.randn(32, 32), torch.randn(32, 32))
    text = format_prediction(predict([gm], get_device("910b")))
    assert "predicted TTFT >=" in text and "source:" in text
    assert "approximate" in text and "no published fp32 peak" in text
