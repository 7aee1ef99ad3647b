"""A guard for code that must never synchronise with the device (what CUDA graphs capture):
inside it, the calls that read a tensor on the host raise."""

import torch

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "unique", "numpy")


def forbid_host_sync(m) -> None:
    """Make every host read raise, through ``m`` (a ``monkeypatch`` or its ``context()``)."""
    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name}")
        return raise_
    for name in HOST_READS:
        m.setattr(torch.Tensor, name, forbidden(name))
    m.setattr(torch, "nonzero", forbidden("nonzero"))
    m.setattr(torch, "unique", forbidden("unique"))
