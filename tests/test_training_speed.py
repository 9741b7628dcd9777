"""Training speed on one machine (issue 21): train.precision (bf16 autocast where the device runs it natively,
refused where it would be emulated, fp32 weights and loss either way, the same seed still gives the same
weights) and the fused AdamW. No Spark."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recsys.config import load_config
from recsys.errors import ConfigError
from recsys.learning.settings import train_settings
from recsys.model import precision as precision_module
from recsys.model import training as training_module
from recsys.model.precision import resolve_precision
from recsys.model.training import TrainSettings, fit
from recsys.scoring import core as core_module

from test_training import CONFIG, FAST, successor_task

CPU = torch.device("cpu")


@pytest.fixture
def native_bf16(monkeypatch):
    """Pretend the CPU runs bf16 natively, so the bf16 path runs (emulated if need be: tiny models) on any CPU."""
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: True)


@pytest.fixture
def no_bf16(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: False)


def test_auto_picks_bf16_only_where_it_is_native(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: True)
    assert resolve_precision("auto", "cpu") == "bf16"
    assert resolve_precision("fp32", "cpu") == "fp32"
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: False)
    assert resolve_precision("auto", "cpu") == "fp32"


def test_a_onednn_cap_below_its_bf16_kernels_makes_auto_train_in_fp32(monkeypatch):
    """A CPU with AMX-BF16 whose oneDNN the operator holds to AVX2 would emulate bf16: auto is fp32 there."""
    monkeypatch.setattr(precision_module, "cpu_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": True})
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: bf16 is never native")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert resolve_precision("auto", "cpu") == "bf16"
    for cap in ("avx2", "AVX512_CORE", "AVX512_CORE_VNNI"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert resolve_precision("auto", "cpu") == "fp32", cap
    with pytest.raises(ValueError, match=r"train\.precision=bf16 needs native bf16"):
        resolve_precision("bf16", "cpu")
    for cap in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL"):          # caps that keep a bf16 kernel
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert resolve_precision("auto", "cpu") == "bf16", cap


def test_bf16_where_it_would_be_emulated_is_refused_naming_the_fix(no_bf16):
    with pytest.raises(ValueError, match=r"train\.precision=bf16 needs native bf16.*AVX-512-BF16.*"
                                         r"use train\.precision=auto .* or fp32"):
        resolve_precision("bf16", "cpu")
    train, _ = successor_task(users=20)
    with pytest.raises(ValueError, match=r"train\.precision=bf16 needs native bf16"):
        fit(train, CONFIG, TrainSettings(epochs=1, batch_size=16, num_threads=1, precision="bf16"))


def test_an_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16, got 'fp16'"):
        TrainSettings(precision="fp16")
    with pytest.raises(ValueError, match="auto, fp32, bf16"):
        resolve_precision("float16", "cpu")
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(overrides=["train.precision=fp16"])


def test_the_config_resolves_for_the_training_device_and_refuses_bf16_there_as_bad_configuration(monkeypatch):
    cfg = load_config()
    assert cfg.train.precision == "auto"
    assert train_settings(cfg.train).precision == "auto"              # no device: fit resolves it
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: True)
    assert train_settings(cfg.train, CPU).precision == "bf16"
    monkeypatch.setattr(precision_module, "cpu_bf16_supported", lambda: False)
    assert train_settings(cfg.train, CPU).precision == "fp32"
    with pytest.raises(ConfigError, match=r"train\.precision=bf16 needs native bf16"):   # exit 2, not a crash
        train_settings(load_config(overrides=["train.precision=bf16"]).train, CPU)


def test_the_scoring_core_uses_the_same_capability_check():
    assert core_module.cpu_bf16_supported is precision_module.cpu_bf16_supported


def _linear_output_dtypes(monkeypatch) -> set[torch.dtype]:
    """Record the dtype of every nn.Linear output of the models ``fit`` builds."""
    seen: set[torch.dtype] = set()
    build = training_module.build_model

    def build_and_watch(config):
        model = build(config)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
        return model

    monkeypatch.setattr(training_module, "build_model", build_and_watch)
    return seen


@pytest.mark.parametrize("precision, expected", [("fp32", {torch.float32}), ("bf16", {torch.bfloat16})])
def test_bf16_runs_the_products_under_autocast_and_keeps_fp32_weights(monkeypatch, native_bf16, precision, expected):
    seen = _linear_output_dtypes(monkeypatch)
    train, _ = successor_task(users=20)
    result = fit(train, CONFIG, TrainSettings(epochs=1, batch_size=16, num_threads=1, precision=precision))
    assert seen == expected
    assert {p.dtype for p in result.model.parameters()} == {torch.float32}
    assert all(torch.isfinite(torch.tensor(row["train_loss"])) for row in result.curve)


def test_bf16_training_learns_the_pattern_and_repeats_exactly(native_bf16):
    train, valid = successor_task()
    settings = replace(FAST, precision="bf16")
    result = fit(train, CONFIG, settings, valid=valid)
    assert result.best_metrics["ndcg@10"] > 0.8
    again = fit(train, CONFIG, settings, valid=valid)
    a, b = result.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_optimizer_is_fused_on_the_cpu_and_keeps_its_groups():
    from recsys.model.sasrec import SASRec

    optimizer = training_module._optimizer(SASRec(CONFIG), TrainSettings(weight_decay=0.1))
    assert optimizer.defaults["fused"] is True
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_bf16_with_the_sampled_softmax_learns_too(native_bf16):
    """The sampled loss runs under the same autocast: its log-q correction meets fp32 hidden states (the
    final LayerNorm's output), its logits are cast up for the cross-entropy."""
    train, valid = successor_task()
    result = fit(train, CONFIG, replace(FAST, precision="bf16", loss="sampled", negatives=16), valid=valid)
    assert result.best_metrics["ndcg@10"] > 0.8
