"""`bole serve --engine-process` on the CPU: the engine runs in a process of its own. Two
concurrent greedy completions, one streamed, equal the offline engine's output; a stream the
client abandons frees its slot; bad requests get a 400; /metrics parses; SIGTERM stops every
process. An engine whose build fails is a clean error, and --tp is refused with it."""

import time

import pytest

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from bole.assets import code_prompts  # noqa: E402
from bole.distributed import free_port  # noqa: E402
from bole.server.engine_process import EngineClient  # noqa: E402
from tests.server.served import Served, offline  # noqa: E402


def test_serve_with_the_engine_in_its_own_process(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    from tokenizers import Tokenizer

    from bole.assets import BUNDLED_MODEL
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in code_prompts()[:2]]
    with Served(tmp_path, "--engine-process") as served:
        url = served.url
        assert served.spawned, "no engine process"
        text, n, ids = served.plain_and_streamed(prompts)
        want_ids, want_texts = offline(prompts, tok)
        assert ids == want_ids[1]
        assert n == len(want_ids[0]) and text == want_texts[0]

        bad = httpx.post(url + "/v1/completions", json=dict(model="bundled", prompt="x",
                                                            max_tokens=-1), timeout=10)
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]

        # a stream abandoned after its first chunk: its slot is free again within rounds
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json=dict(model="bundled", prompt=prompts[0], max_tokens=200,
                                    temperature=0, stream=True)) as res:
            next(res.iter_lines())
        deadline = time.time() + 20
        while httpx.get(url + "/health", timeout=5).json()["running"] and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(url + "/health", timeout=5).json() == dict(status="ok", running=0,
                                                                    waiting=0)
        names = {f.name for f in text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=5).text)}
        assert {"bole_rounds", "bole_admission_seconds", "bole_step_seconds"} <= names
    assert served.returncode == 0, served.output
    assert not served.left, f"processes left behind: {served.left}\n{served.output}"


def _failing_engine(message: str):
    raise ValueError(message)


def test_an_engine_that_cannot_start_is_a_clean_error():
    with pytest.raises(RuntimeError, match="could not start: ValueError: no such checkpoint"):
        EngineClient(_failing_engine, ("no such checkpoint",), startup_timeout=120)


def test_engine_process_with_tp_is_a_usage_error(capsys):
    from bole.cli import main
    assert main(["serve", "--engine-process", "--tp", "2", "--device", "cpu",
                 "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "--engine-process" in err and "Traceback" not in err
