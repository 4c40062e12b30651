"""The test suite collects as one run: pytest imports test modules by basename (rootdir-relative
``sys.path`` insertion, no packages in the tiers), so two tiers holding a ``test_x.py`` each
stop the whole run at collection ("import file mismatch")."""

from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique_across_tiers():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if names[p.name] > 1)
