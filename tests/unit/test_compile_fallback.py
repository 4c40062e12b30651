"""Without a C compiler (or the Python headers) FlexAttention cannot compile: the shared-prompt
forward falls back to the dense mask on CUDA, with one warning per process."""

import logging
from types import SimpleNamespace

import pytest
import torch

from distflow.engines import model_ops

pytestmark = pytest.mark.unit

CUDA = torch.device("cuda", 0)


@pytest.fixture
def sdpa_model():
    return SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))


@pytest.fixture
def fresh_check():
    model_ops.can_compile.cache_clear()
    yield
    model_ops.can_compile.cache_clear()


def test_no_c_compiler_on_path_picks_dense_on_cuda_with_one_warning(sdpa_model, fresh_check, monkeypatch,
                                                                     tmp_path, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no gcc, no clang
    with caplog.at_level(logging.WARNING, logger=model_ops.__name__):
        picks = [model_ops.shared_attention_backend(sdpa_model, CUDA) for _ in range(3)]
    assert picks == ["dense", "dense", "dense"]
    warnings = [r for r in caplog.records if "FlexAttention cannot compile" in r.getMessage()]
    assert len(warnings) == 1 and "C compiler" in warnings[0].getMessage()


def test_missing_python_headers_picks_dense_on_cuda(sdpa_model, fresh_check, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/usr/bin/cc")
    monkeypatch.setattr(model_ops.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert model_ops.shared_attention_backend(sdpa_model, CUDA) == "dense"


def test_a_compiler_and_headers_keep_flex_on_cuda(sdpa_model, fresh_check, monkeypatch, tmp_path):
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setenv("CC", "/usr/bin/cc")
    monkeypatch.setattr(model_ops.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert model_ops.shared_attention_backend(sdpa_model, CUDA) == "flex"
    # An explicit request is kept: the user asked for FlexAttention.
    model_ops.can_compile.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC")
    assert model_ops.shared_attention_backend(sdpa_model, CUDA, "flex") == "flex"
