"""Test set-up: Triton kernels run under the interpreter on machines without a GPU; every test
starts from the same global random state; hypothesis is derandomised in CI.

TRITON_INTERPRET must be set before triton is first imported, hence here at collection time.
``CI`` set (``.ci/run`` sets it) loads the ``ci`` hypothesis profile: the same examples every run.
"""

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "bole", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile(
    "ci", parent=settings.get_profile("bole"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "bole")


@pytest.fixture(autouse=True)
def _seed_global_rngs():
    """Seed torch's, numpy's and Python's global generators before each test, so that a test
    drawing from them (``torch.randn`` without a generator, ...) sees the same numbers whatever
    ran before it or in which shard."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def pytest_collection_modifyitems(config, items):
    """``BOLE_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th (0-based), so that n
    pytest processes can share one GPU and the CPUs compiling its kernels (no pytest-xdist on the
    device). Unset: every test."""
    shard = os.environ.get("BOLE_TEST_SHARD", "").strip()
    if not shard:
        return
    try:
        i, n = (int(x) for x in shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"BOLE_TEST_SHARD={shard!r} must be 'i/n' with 0 <= i < n, e.g. '0/4'")
    keep = [item for j, item in enumerate(items) if j % n == i]
    config.hook.pytest_deselected(items=[item for j, item in enumerate(items) if j % n != i])
    items[:] = keep
