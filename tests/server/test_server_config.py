"""The server's settings: an empty API key is refused (it would lock every client out, or
read as no key), a key or no key is taken."""

from __future__ import annotations

import pytest

from bole.server.api import ServerConfig


def test_an_empty_api_key_is_refused_and_a_key_or_none_is_taken():
    with pytest.raises(ValueError, match="^api_key is empty: pass a key, or None to serve "
                                         "without one$"):
        ServerConfig(api_key="")
    assert ServerConfig(api_key="k").api_key == "k"
    assert ServerConfig().api_key is None
