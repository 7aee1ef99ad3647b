"""Without fla, the GPU prefill's fallback is said once, with the command that installs fla."""

import logging
import sys

from bole.models.layers import gdn


def test_missing_fla_is_said_once_with_the_install_command(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla", None)          # `import fla` fails from here on
    monkeypatch.setattr(gdn, "_fla_missing_said", False)
    with caplog.at_level(logging.WARNING, logger="bole"):
        assert gdn._fla_chunk() is None
        assert gdn._fla_chunk() is None
    said = [r.getMessage() for r in caplog.records if "fla is not importable" in r.getMessage()]
    assert len(said) == 1
    assert f"pip install '{gdn.FLA_REQUIREMENT}'" in said[0]
