"""Test set-up: Triton kernels run under the interpreter on machines without a GPU.

TRITON_INTERPRET must be set before triton is first imported, hence here at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "bole", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile(
    "ci", parent=settings.get_profile("bole"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "bole")
