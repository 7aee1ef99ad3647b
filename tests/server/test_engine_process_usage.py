"""The cache-usage gauge of a server whose engine runs in its own process: the share of the
``max_batch`` slots the engine process reports running (one slot when no ``max_batch``)."""

import pytest

pytest.importorskip("fastapi")

from bole.server.api import BoleServer  # noqa: E402
from tests.server.scripted import ScriptedEngine, tokenizer  # noqa: E402


class _Client:
    """What BoleServer reads of an EngineClient, with the counts the engine process sent."""

    def __init__(self, running: int):
        self.info = ScriptedEngine().info
        self.num_running, self.num_waiting, self.on_round = running, 0, None


def _usage(server: BoleServer) -> float:
    line = next(x for x in server.metrics.render().decode().splitlines()
                if x.startswith("vllm:gpu_cache_usage_perc{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("max_batch, running, share", [(4, 1, 0.25), (4, 3, 0.75),
                                                        (8, 2, 0.25), (None, 1, 1.0),
                                                        (4, 0, 0.0)])
def test_an_engine_process_servers_usage_is_running_over_its_slots(max_batch, running, share):
    server = BoleServer(None, "scripted", client=_Client(running), tokenizer=tokenizer(),
                        max_batch=max_batch)
    assert _usage(server) == pytest.approx(share)
