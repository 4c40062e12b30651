"""The GPU check's own logic, without a GPU: what it calls exists, and how it judges and reports.

A GPU run is rare and short, so a call to a function that does not exist, a
multi-GPU part that "passes" on one GPU, or a hung part that eats the whole
run must be caught here, before the run.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.bench import gpu_check, gpu_models, gpu_vllm

pytestmark = pytest.mark.unit


def _bench_calls() -> list[tuple[types.ModuleType, ast.Call]]:
    """Calls ``alias.function(...)`` in gpu_check.py on modules it imports (anywhere) from tests.bench."""
    tree = ast.parse(Path(gpu_check.__file__).read_text())
    modules = {alias.asname or alias.name: importlib.import_module(f"tests.bench.{alias.name}")
               for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "tests.bench"
               for alias in node.names}
    return [(modules[node.func.value.id], node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in modules]


def test_every_function_gpu_check_calls_in_a_bench_module_exists_and_takes_those_arguments():
    calls = _bench_calls()
    for module, call in calls:
        assert hasattr(module, call.func.attr), f"{module.__name__} has no {call.func.attr} (line {call.lineno})"
        target = getattr(module, call.func.attr)
        if callable(target):
            inspect.signature(target).bind(*call.args, **{k.arg: k.value for k in call.keywords})
    called = {f"{module.__name__}.{call.func.attr}" for module, call in calls}
    assert {"tests.bench.gpu_vllm.measure", "tests.bench.gpu_exchange.exchange_check",
            "tests.bench.gpu_update.update_check", "tests.bench.gpu_runs.job_check"} <= called


def _ctx(device_type: str, tmp_path) -> gpu_check.Context:
    return gpu_check.Context(torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu"),
                             "NVIDIA H200", tmp_path)


@pytest.mark.parametrize("part", ["exchange", "allgather"])
def test_multi_gpu_parts_on_one_gpu_are_not_run_and_say_why(part, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = getattr(gpu_check, part)(_ctx("cuda", tmp_path))
    assert out["status"] == "not-run"
    assert out["why"].startswith("needs >= 2 GPUs")


def test_the_vllm_part_calls_measure_and_reports_a_missing_vllm_as_not_run(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_vllm, "measure", lambda: {"vllm": "not installed: ModuleNotFoundError: vllm"})
    out = gpu_check.vllm(_ctx("cuda", tmp_path))
    assert out == {"status": "not-run",
                   "why": "vLLM not installed: ModuleNotFoundError: vllm (its wheel is too large to carry)"}
    monkeypatch.setattr(gpu_vllm, "measure", lambda: {"vllm": "0.9", "greedy_equals_hf_after_sync": False})
    assert gpu_check.vllm(_ctx("cuda", tmp_path))["status"] == "fail"


def test_a_part_past_its_deadline_is_killed_with_its_children_and_fails(monkeypatch, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    monkeypatch.setattr(gpu_check, "child_command", lambda *a: [sys.executable, "-c", script])
    start = time.monotonic()
    out = gpu_check.run_part(gpu_check.PARTS[0], "cpu", tmp_path, timeout_s=3)
    assert time.monotonic() - start < 30
    assert out["status"] == "fail" and out["why"] == "deadline: killed after 3 s"
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(grandchild)], capture_output=True, text=True).stdout
    assert state.strip()[:1] in ("", "Z"), state  # gone, or a zombie of init's ("ZN" when run under nice)


def test_the_json_is_rewritten_after_every_part_and_ok_needs_every_part(monkeypatch, tmp_path):
    seen = []
    verdicts = {"device_copy": "pass", "exchange": "not-run", "ppo": "fail"}

    def fake_run_part(part, device_type, work, timeout_s):
        if seen:
            seen[-1]["on_disk"] = list(json.loads(out.read_text())["parts"])
        seen.append({"name": part.name})
        return {"status": verdicts.get(part.name, "pass"), "why": "x"}

    out = tmp_path / "gpu.json"
    monkeypatch.setattr(gpu_check, "run_part", fake_run_part)
    result = gpu_check.run_check("cpu", [out], budget_s=1000)
    names = [p.name for p in gpu_check.PARTS]
    assert [s.get("on_disk") for s in seen[:-1]] == [names[:i + 1] for i in range(len(names) - 1)]
    assert result["complete"] and result["ok"] is False  # ppo failed
    verdicts["ppo"] = "pass"
    assert gpu_check.run_check("cpu", [out], budget_s=1000)["ok"] is True
    assert json.loads(out.read_text())["ok"] is True


def test_a_part_that_the_budget_cannot_start_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "run_part", lambda *a: {"status": "pass"})
    result = gpu_check.run_check("cpu", [tmp_path / "gpu.json"], budget_s=gpu_check.MIN_START_S - 1)
    assert {p["status"] for p in result["parts"].values()} == {"fail"}
    assert result["ok"] is False


def test_update_mfu_is_six_flops_per_parameter_per_token_over_the_peak():
    # 1.31e9 parameters x 12,288 tokens x 6 = 9.66e13 FLOPs; in 0.25 s at 989 TFLOP/s: 39.1%
    assert gpu_models.update_mfu(1_310_000_000, 12_288, 0.25, 989e12) == pytest.approx(0.39063, abs=1e-5)
    assert gpu_models.update_mfu(1, 1, 1.0, None) is None
    assert gpu_models.peak_bf16_flops("NVIDIA H200") == 989e12


def test_qwen2_parameter_counts_match_the_models_built_from_the_configs():
    from transformers import AutoModelForCausalLM

    from distflow.models import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    for shape in (gpu_models.QWEN2_SHAPES["tiny"], (96, 160, 2, 6, 2)):
        config = gpu_models.qwen2_config(shape, tokenizer)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert gpu_models.num_params(shape, len(tokenizer)) == sum(p.numel() for p in model.parameters())
    # Qwen2-1.5B without its 151,936-row embeddings: 1.31 B parameters (its model card: 1.54 B in all)
    assert gpu_models.num_params(gpu_models.QWEN2_SHAPES["1.5b"], 259) == pytest.approx(1.31e9, rel=0.01)
    assert gpu_models.largest_fitting(140 * 2**30) == "3b"  # 7b: 6.53e9 x 20 B = 122 GiB > 0.8 x 140 GiB


def test_carried_wheels_are_the_locked_versions_and_every_python_gets_its_own_pydantic_core(tmp_path):
    import zipfile

    from tests.bench import gpu_wheels

    pins = gpu_wheels.locked_versions()
    assert set(pins) == set(gpu_wheels.PACKAGES)
    lock = (gpu_wheels.REPO_ROOT / "requirements.lock").read_text().splitlines()
    assert f"pydantic=={pins['pydantic']}" in lock and f"pydantic-core=={pins['pydantic-core']}" in lock
    for version in ("3.12", "3.13"):  # a cached set: built without the package index
        folder = tmp_path / "cache" / f"cp{version.replace('.', '')}"
        folder.mkdir(parents=True)
        for name, pin in pins.items():
            module = name.replace("-", "_")
            tag = f"cp{version.replace('.', '')}"
            with zipfile.ZipFile(folder / f"{module}-{pin}-{tag}-{tag}-manylinux2014_x86_64.whl", "w") as wheel:
                wheel.writestr(f"{module}/__init__.py", "")
                if name == "pydantic-core":
                    wheel.writestr(f"{module}/_pydantic_core.cpython-{tag[2:]}-x86_64-linux-gnu.so", "")
    site = gpu_wheels.build_site(tmp_path / "site", ("3.12", "3.13"), tmp_path / "cache")
    assert sorted(p.name for p in (site / "pydantic_core").glob("*.so")) == [
        "_pydantic_core.cpython-312-x86_64-linux-gnu.so", "_pydantic_core.cpython-313-x86_64-linux-gnu.so"]
    bad_lock = tmp_path / "requirements.lock"
    bad_lock.write_text("pydantic==2.0 ; python_full_version < '3.11'\n")
    with pytest.raises(ValueError, match="pins no single version of"):
        gpu_wheels.locked_versions(bad_lock)


@pytest.mark.parametrize("eager_diff, status", [(5e-4, "pass"), (2e-3, "fail")])
def test_attention_backends_fail_when_a_backend_strays_past_the_tolerance(eager_diff, status, monkeypatch, tmp_path):
    from tests.bench import shared_attention

    rows = [{"max_abs_lp_diff": {"dense": 1e-6, "flex": 2e-4}}, {"max_abs_lp_diff": {"dense": 3e-6}}]
    monkeypatch.setattr(shared_attention, "run", lambda **kw: {"rows": rows})
    monkeypatch.setattr(shared_attention, "eager_vs_sdpa", lambda *a: eager_diff)
    out = gpu_check.attention_backends(_ctx("cuda", tmp_path))
    assert out["worst_abs_lp_diff"] == {"dense": 3e-6, "flex": 2e-4, "eager": eager_diff}
    assert out["atol"] == 1e-3 and out["status"] == status


def test_every_test_module_the_gpu_check_imports_loads_without_pytest():
    """The GPU machine has no pytest: modules under tests/ that the parts import (some only inside a
    function) must not import it at the top (tests/dist/_jobs.py once did and failed ``grpo_0.5b``)."""
    tree = ast.parse("\n".join(Path(m.__file__).read_text() for m in
                               (gpu_check, gpu_models, gpu_vllm, importlib.import_module("tests.bench.gpu_runs"),
                                importlib.import_module("tests.bench.gpu_exchange"))))
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("tests.")]
    modules = sorted({f"{node.module}.{alias.name}" if node.module == "tests.bench" else node.module
                      for node in imports for alias in node.names})
    assert {"tests.dist._jobs", "tests.dist._spawn", "tests.bench.gpu_runs"} <= set(modules)
    blocker = ("import sys, importlib.abc\n"
               "class NoPytest(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('pytest', '_pytest'):\n"
               "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
               "sys.meta_path.insert(0, NoPytest())\n"
               f"for m in {modules!r}: importlib.import_module(m)\n")
    repo = Path(gpu_check.__file__).parents[2]
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
