"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import numpy as np
import torch


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def check_kernel_device(device: torch.device | str, what: str, interpret: bool | None = None) -> None:
    """Compiled Triton kernels take CUDA tensors; on another device they run only under the
    interpreter. Raise a ValueError saying so (Triton's own error names a pointer argument)."""
    device = torch.device(device)
    if device.type != "cuda" and not (interpreting() if interpret is None else interpret):
        raise ValueError(
            f"{what} got tensors on {device}, but the compiled Triton kernels need CUDA tensors: "
            f"move them to a GPU, use the torch backend (gdn_backend='torch'), or set "
            f"TRITON_INTERPRET=1 before triton is imported for its (slow) CPU interpreter")


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the first of ``tensors`` (None ones skipped) that is not on
    ``device``, the device of q (every kernel input lives on one device)."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; put every input on "
                             "one device")


def fix_interpreter_scalar_index() -> None:
    """Make Triton's CPU interpreter accept loaded scalars as loop bounds under NumPy >= 2.4.

    The interpreter (Triton 3.6) holds every scalar as a shape-(1,) array and converts it for
    ``range(lo, hi)`` with ``int(array)``, which NumPy 2.4 rejects ("only 0-dimensional arrays can
    be converted to Python scalars"). This re-registers ``__index__`` to read the single element.
    Only active when ``TRITON_INTERPRET=1``; compiled kernels are unaffected. Idempotent.
    """
    if not interpreting():
        return
    from triton.runtime import interpreter as interp

    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_bole_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._bole_fixed = True
    interp._patch_lang_tensor = patched


