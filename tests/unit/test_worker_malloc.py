"""DISTFLOW_MMAP_THRESHOLD fixes glibc's mmap threshold in a worker (peak RSS for speed); off by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distflow.malloc import configure_malloc

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("environ", [
    {},
    {"DISTFLOW_MMAP_THRESHOLD": "0"},
    {"DISTFLOW_MMAP_THRESHOLD": "524288", "MALLOC_MMAP_THRESHOLD_": "65536"},
    {"DISTFLOW_MMAP_THRESHOLD": "524288", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
])
def test_left_alone_by_default_or_when_glibc_is_configured(environ):
    assert configure_malloc(environ) == 0


def test_sets_the_threshold_when_asked():
    # In a child: mallopt changes the whole process's allocator.
    code = ("from distflow.malloc import configure_malloc as c; "
            "print(c({'DISTFLOW_MMAP_THRESHOLD': '131072'}), "
            "c({'DISTFLOW_MMAP_THRESHOLD': '524288', 'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'}))")
    paths = os.pathsep.join(str(REPO / p) for p in ("worker_image", "operator", "."))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": paths},
                         capture_output=True, text=True, check=True).stdout.split()
    if sys.platform != "linux" or out[0] == "0":
        pytest.skip("not glibc")
    assert out == ["131072", "524288"]
