"""tools/mutation_recheck.sh in one process: each named mutant (MUTANT_UNDER_TEST=<name>, which
mutmut's trampolines read at every call) against ``pytest.main([-x, ...])`` in this process, so
that torch and the test modules are imported once, not once a mutant (seconds each on a small
machine). For modules whose tests hold no state across runs (module-scoped fixtures are rebuilt:
each pytest.main is a new session). Run in the mutants/ folder of a work directory
tools/mutation.sh made, after copying the new test files there:

    cd /tmp/m-accept/mutants && TRITON_INTERPRET=1 \\
      python /work/main/tools/mutation_recheck_inprocess.py NAMES_FILE OUT_FILE \\
      tests/speculative/test_accept_device.py -k "not fused_greedy"

NAMES_FILE: one mutant name a line; OUT_FILE gets "<name> killed|survived|timeout|error<rc>"
appended. RECHECK_TIMEOUT (seconds, default 300): a mutant still running then is stopped by a
``TimeoutError`` raised in the test (a hang the tests catch, counted as a timeout; a hang inside a
C call that never returns to Python still stops the run). Mind -k: it matches substrings ("not
fused" also drops "..._are_refused")."""

import contextlib
import io
import os
import signal
import sys

sys.path.insert(0, os.getcwd())
os.environ.setdefault("OMP_NUM_THREADS", "1")
import pytest  # noqa: E402

names = [line.strip() for line in open(sys.argv[1]) if line.strip()]
args = ["-x", "-q", "-p", "no:cacheprovider", *sys.argv[3:]]
timeout = int(os.environ.get("RECHECK_TIMEOUT", "300"))
fired = False


def _stop(signum, frame):
    global fired
    fired = True
    raise TimeoutError(f"mutant still running after {timeout} s")


signal.signal(signal.SIGALRM, _stop)
with open(sys.argv[2], "a") as out:
    for name in names:
        os.environ["MUTANT_UNDER_TEST"] = name
        fired = False
        signal.alarm(timeout)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = int(pytest.main(args))
        signal.alarm(0)
        status = "timeout" if fired else {0: "survived", 1: "killed"}.get(rc, f"error{rc}")
        print(name, status, file=out, flush=True)
