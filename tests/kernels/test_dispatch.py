"""Backend selection: explicit, environment, device default, fallback, errors."""
import logging

import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _dispatch

from conftest import cpu_backend_available


def test_explicit_unknown_backend_names_the_argument():
    with pytest.raises(ValueError, match="backend='bogus'"):
        tk.rms_norm(torch.randn(2, 4), torch.ones(4), backend="bogus")


@pytest.mark.skipif(not cpu_backend_available(), reason="the C++ extension is not built here")
def test_explicit_backend_that_cannot_serve_raises_with_op_backend_and_reason():
    x = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(tk.BackendUnavailableError, match=r"rms_norm: backend 'cpu'.*float64"):
        tk.rms_norm(x, torch.ones(4, dtype=torch.float64), backend="cpu")


def test_env_backend_is_read_per_call(monkeypatch):
    x, w = torch.randn(3, 8), torch.ones(8)
    seen = []
    op = _dispatch.op("rms_norm")
    monkeypatch.setenv(_dispatch.ENV_VAR, "reference")
    seen.append(op.select(x.device, None, x, w, 1e-6, 0.0))
    if cpu_backend_available():
        monkeypatch.setenv(_dispatch.ENV_VAR, "cpu")
        seen.append(op.select(x.device, None, x, w, 1e-6, 0.0))
        assert seen == ["reference", "cpu"]
    else:
        assert seen == ["reference"]


def test_env_backend_that_cannot_serve_falls_back_and_logs_once(monkeypatch, caplog):
    _dispatch.reset()
    monkeypatch.setenv(_dispatch.ENV_VAR, "npu")
    x, w = torch.randn(3, 8), torch.ones(8)
    with caplog.at_level(logging.INFO, logger="twinkle_kernels"):
        for _ in range(3):
            y = tk.rms_norm(x, w)
    torch.testing.assert_close(y, tk.rms_norm(x, w, backend="reference"))
    npu_lines = [r for r in caplog.records if "'npu'" in r.getMessage()]
    assert len(npu_lines) == 1


def test_env_backend_bad_name_raises(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="TWINKLE_KERNELS_BACKEND"):
        tk.rms_norm(torch.randn(2, 4), torch.ones(4))


def test_device_default_order():
    assert _dispatch.default_order(torch.device("cpu"))[0] == "cpu"
    assert _dispatch.default_order(torch.device("cuda", 0))[0] == "triton"
    assert _dispatch.default_order(torch.device("meta")) == ("reference",)


def test_float64_falls_back_to_reference_silently_correct():
    x = torch.randn(4, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    y = tk.rms_norm(x, w)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, ref)


def test_backends_option_deselects_only_other_backends_cases():
    """``pytest --backends`` (the CI lanes): of the backend-parametrized items only the listed backends'
    stay; items without the parameter, or with backend=None (the automatic choice), always stay."""
    from types import SimpleNamespace
    import conftest

    def item(name, **params):
        return SimpleNamespace(name=name, callspec=SimpleNamespace(params=params) if params else None)

    items = [item("plain"), item("cpu", backend="cpu"), item("ref", backend="reference", dtype="fp32"),
             item("triton", backend="triton"), item("auto", backend=None), item("other", dtype="fp32")]
    gone = []
    config = SimpleNamespace(getoption=lambda name: {"--backends": "cpu, triton"}.get(name),
                             hook=SimpleNamespace(pytest_deselected=lambda items: gone.extend(items)))
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["plain", "cpu", "triton", "auto", "other"]
    assert [i.name for i in gone] == ["ref"]
    config.getoption = lambda name: None     # no option: nothing is deselected
    conftest.pytest_collection_modifyitems(config, items)
    assert len(items) == 5
    config.getoption = lambda name: {"--backends": " , "}.get(name)
    with pytest.raises(pytest.UsageError, match="--backends"):
        conftest.pytest_collection_modifyitems(config, items)


def test_published_entries_option_deselects_only_other_entries():
    """``pytest --published-entries`` (.ci/mcore_latest): test_published_widths' items of the other
    entries are deselected; its items without an entry, and other files' items, stay."""
    from types import SimpleNamespace
    import conftest

    widths = SimpleNamespace(__name__="tests.megatron.test_published_widths")
    other = SimpleNamespace(__name__="tests.kernels.test_x")

    def item(label, module, **params):
        return SimpleNamespace(name=label, module=module, callspec=SimpleNamespace(params=params) if params else None)

    items = [item("moe", widths, name="qwen3_30b_a3b", lay="ep2"), item("dense", widths, name="qwen3_4b"),
             item("frees", widths), item("elsewhere", other, name="qwen3_4b")]
    gone = []
    config = SimpleNamespace(getoption=lambda name: {"--published-entries": "qwen3_30b_a3b"}.get(name),
                             hook=SimpleNamespace(pytest_deselected=lambda items: gone.extend(items)))
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["moe", "frees", "elsewhere"] and [i.name for i in gone] == ["dense"]
    config.getoption = lambda name: {"--published-entries": "qwen3_30b_a3b,bogus"}.get(name)
    with pytest.raises(pytest.UsageError, match="--published-entries.*bogus"):
        conftest.pytest_collection_modifyitems(config, items)
