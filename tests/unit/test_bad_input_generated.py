"""Hundreds of bad configs mutated from the examples (tests/bad_configs.py), each rejected by
`distflow validate` before any worker starts, with a message that names the field and no traceback.

In-process for speed (the CLI's own ``main``); a few also through the real command, and
`distflow run` of a few stops before it starts a worker. The same mutations as custom
resources on a real API server are tests/operator/test_bad_resources.py.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distflow.cli import main
from distflow.launcher import EXIT_INVALID_CONFIG
from tests.bad_configs import CATEGORIES, categories, generate

pytestmark = pytest.mark.unit

CONFIGS = generate()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@pytest.mark.parametrize("bad", CONFIGS, ids=[c.name for c in CONFIGS])
def test_bad_config_is_rejected_before_any_worker_naming_the_field(bad, tmp_path, capsys):
    config = bad.write(tmp_path)
    code = main(["validate", str(config)])
    captured = capsys.readouterr()
    assert code == EXIT_INVALID_CONFIG, captured.out + captured.err
    assert captured.err.startswith("distflow: "), captured.err
    assert bad.expected(config) in captured.err, captured.err
    assert "Traceback" not in captured.err


def test_the_generated_set_covers_every_category_and_the_docs_say_how_many():
    counts = categories(CONFIGS)
    assert all(counts[c] >= 5 for c in CATEGORIES), counts
    text = " ".join(DOCS.read_text().split())
    stated = int(re.search(r"at least (\d+) bad configs", text).group(1))
    assert len(CONFIGS) >= stated >= 200, (len(CONFIGS), stated)
    for category in CATEGORIES:
        assert re.search(rf"{category} \({counts[category]}[):]", text), (category, counts[category])


@pytest.mark.parametrize("command, name", [
    ("validate", "quickstart:data.trainBatchSize:wrong type"),
    ("validate", "data.train: no prompt field"),
    ("validate", "config file: not YAML"),
    ("validate", "manifest kind RLPostTrainJobs"),
    ("validate", "custom node: no such module"),
    ("run", "quickstart: greedy group sampling"),
    ("run", "data.train: empty"),
])
def test_the_real_command_rejects_them_too(command, name, tmp_path):
    (bad,) = [c for c in CONFIGS if c.name == name]
    config = bad.write(tmp_path)
    done = subprocess.run([sys.executable, "-m", "distflow.cli", command, str(config)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == EXIT_INVALID_CONFIG, done.stdout + done.stderr
    assert bad.expected(config) in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # no worker started: nothing logged
