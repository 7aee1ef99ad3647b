"""Plant again each bug of issue 49's audit (the nine the whole suite once let through, and two
in the scheduler's admission, which a crash alone once caught) in a copy of the committed tree,
one at a time, and run the tests that stand for it: each must fail with an assertion (a failed
``assert`` or an ``AssertionError``), not only with a crash, and pass on the code unplanted
(``--baseline``). A plant that no longer matches the code is reported, not skipped: edit it here
when the code moves.

    python tools/planted_bugs.py                  # every bug (about 10 minutes on two cores)
    python tools/planted_bugs.py stop_last_match  # some, by name
    python tools/planted_bugs.py --baseline       # also run the tests on the unplanted copy

Prints a line per bug and exits 1 unless every planted bug fails its tests with an assertion."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plant:
    """One bug: ``old`` (which must occur exactly once in ``path``) becomes ``new``."""

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


PLANTS = (
    Plant("greedy_rows", "the round writes greedy sampling parameters for every row",
          "bole/engine/round.py",
          "b.sampling.write([r.params for r in requests],",
          "b.sampling.write([type(r.params)(temperature=0.0) for r in requests],",
          ("tests/engine/test_round_sampling.py",)),
    Plant("mtp_after_commit", "the MTP head's cache positions read after the commit",
          "bole/engine/phases.py",
          "out.hidden, ctx,", "out.hidden, self.cache.lengths[b.slots.long()].clone(),",
          ("tests/engine/test_user_visible.py::"
           "test_mtp_pool_rows_are_the_committed_positions_after_every_round",
           "tests/engine/test_user_visible.py::"
           "test_bundled_model_acceptance_is_in_its_measured_band")),
    Plant("stop_last_match", "stop strings cut at the last match", "bole/engine/request.py",
          "return text[: min(hits)] if hits else text",
          "hits = [text.rfind(s) for s in params.stop if s in text]\n"
          "    return text[: max(hits)] if hits else text",
          ("tests/engine/test_user_visible.py::"
           "test_stop_strings_cut_at_the_first_match_across_tokens_and_strings",
           "tests/engine/test_user_visible.py::"
           "test_result_text_cuts_before_the_first_of_several_matches")),
    Plant("finish_always_stop", "the last streamed chunk always says stop",
          "bole/server/responses.py",
          'yield sse(completion_chunk(rid, model, "", seq.finish_reason, chat,',
          'yield sse(completion_chunk(rid, model, "", "stop", chat,',
          ("tests/server/test_stream_contract.py::test_length",)),
    Plant("total_without_prompt", "usage.total_tokens leaves out the prompt",
          "bole/server/protocol.py",
          '"total_tokens": prompt_tokens + completion_tokens,',
          '"total_tokens": completion_tokens,',
          ("tests/server/test_stream_contract.py::test_length",)),
    Plant("no_done", "no data: [DONE] at the end of a stream", "bole/server/responses.py",
          'yield "data: [DONE]\\n\\n"', "pass",
          ("tests/server/test_stream_contract.py::test_stream_without_usage_ends_in_done",
           "tests/server/test_stream_contract.py::test_length")),
    Plant("conv_bias_after_silu", "the conv reference adds its bias after the SiLU",
          "bole/ops/conv.py",
          "    if bias is not None:\n        out = out + bias.to(dt)\n"
          "    if activation == \"silu\":\n        out = F.silu(out)",
          "    if activation == \"silu\":\n        out = F.silu(out)\n"
          "    if bias is not None:\n        out = out + bias.to(dt)",
          ("tests/ops/test_conv_bias.py",)),
    Plant("cancel_one_round_late", "a cancelled request leaves a step late (its slot with it)",
          "bole/engine/scheduler.py",
          "        self._retire(cancelled_only=True)\n        admitted = self._admit()",
          "        admitted = self._admit()",
          ("tests/engine/test_user_visible.py::"
           "test_a_cancel_frees_the_slot_for_the_waiting_request_in_the_next_step",)),
    Plant("cancel_after_round", "cancelled requests retired only after the round",
          "bole/engine/scheduler.py",
          "        self._retire(cancelled_only=True)\n        admitted = self._admit()\n"
          "        if admitted:                    # cancelled while their prompts were "
          "prefilled: no round\n            self._retire(cancelled_only=True)",
          "        admitted = self._admit()",
          ("tests/engine/test_user_visible.py::"
           "test_a_cancel_frees_the_slot_for_the_waiting_request_in_the_next_step",
           "tests/engine/test_scheduler.py::"
           "test_a_request_cancelled_during_its_admission_runs_no_round")),
    Plant("depth_tie_shallower", "draft-depth choice breaks rate ties toward the shallower depth",
          "bole/speculative/budget/draft_depth.py",
          "if rate > best_rate:", "if rate >= best_rate:",
          ("tests/engine/test_user_visible.py::"
           "test_draft_depth_breaks_a_rate_tie_towards_the_deeper_depth",)),
    Plant("admit_lifo", "admission takes the newest waiting request first",
          "bole/engine/scheduler.py", "handle = self.waiting.popleft()",
          "handle = self.waiting.pop()",
          ("tests/engine/test_user_visible.py::"
           "test_admission_is_fifo_bounded_by_the_batch_and_skips_cancelled_requests",)),
    Plant("admit_past_max_batch", "admission ignores max_batch", "bole/engine/scheduler.py",
          "return min(self.max_batch - len(self.running), self.engine.cache.num_free)",
          "return self.engine.cache.num_free",
          ("tests/engine/test_user_visible.py::"
           "test_admission_is_fifo_bounded_by_the_batch_and_skips_cancelled_requests",)),
)


def _copy_tree(dest: Path) -> None:
    """The committed tree (``git archive HEAD``) into ``dest``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def _run_tests(tree: Path, tests: tuple[str, ...], report: Path) -> tuple[int, list[str]]:
    """pytest on ``tests`` in ``tree``: (failed tests, kinds of their failures)."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    report.unlink(missing_ok=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={report}", *tests], cwd=tree, env=env,
                         capture_output=True, text=True)
    if not report.exists():
        raise RuntimeError(f"pytest ran no tests (exit {run.returncode}):\n"
                           f"{(run.stdout + run.stderr)[-2000:]}")
    kinds = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = bad.get("message", "")
            assertion = bad.tag == "failure" and (message.startswith("assert")
                                                  or "AssertionError" in message)
            kinds.append("assertion" if assertion else f"{bad.tag}: {message[:80]}")
    return len(kinds), kinds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="plants to run (default: all)")
    ap.add_argument("--baseline", action="store_true",
                    help="also run each plant's tests on the unplanted copy (they must pass)")
    args = ap.parse_args(argv)
    unknown = set(args.names) - {p.name for p in PLANTS}
    if unknown:
        ap.error(f"unknown plants {sorted(unknown)}; known: {[p.name for p in PLANTS]}")
    plants = [p for p in PLANTS if not args.names or p.name in args.names]
    ok = True
    with tempfile.TemporaryDirectory(prefix="bole-planted-") as tmp:
        tree, report = Path(tmp) / "tree", Path(tmp) / "report.xml"
        _copy_tree(tree)
        for plant in plants:
            path = tree / plant.path
            original = path.read_text()
            if args.baseline:
                failed, kinds = _run_tests(tree, plant.tests, report)
                if failed:
                    ok = False
                    print(f"{plant.name}: the tests fail on the unplanted code: {kinds}")
                    continue
            if original.count(plant.old) != 1:
                ok = False
                print(f"{plant.name}: the plant no longer matches {plant.path} "
                      f"({original.count(plant.old)} matches): update tools/planted_bugs.py")
                continue
            path.write_text(original.replace(plant.old, plant.new))
            try:
                failed, kinds = _run_tests(tree, plant.tests, report)
            finally:
                path.write_text(original)
            caught = "assertion" in kinds
            ok &= caught
            print(f"{plant.name}: {'caught' if caught else 'NOT CAUGHT'} ({plant.what}): "
                  f"{failed} failing test(s), "
                  f"{kinds.count('assertion')} by an assertion"
                  + ("" if all(k == "assertion" for k in kinds) else f"; others: "
                     f"{sorted(set(k for k in kinds if k != 'assertion'))}"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
