"""tools/mutation_recheck.sh in one process: each named mutant (MUTANT_UNDER_TEST=<name>, which
mutmut's trampolines read at every call) against ``pytest.main([-x, ...])`` in this process, so
that torch and the test modules are imported once, not once a mutant (seconds each on a small
machine). For modules whose tests hold no state across runs (module-scoped fixtures are rebuilt:
each pytest.main is a new session). Run in the mutants/ folder of a work directory
tools/mutation.sh made, after copying the new test files there:

    cd /tmp/m-accept/mutants && TRITON_INTERPRET=1 \\
      python /work/main/tools/mutation_recheck_inprocess.py NAMES_FILE OUT_FILE \\
      tests/speculative/test_accept_device.py -k "not fused_greedy"

NAMES_FILE: one mutant name a line; OUT_FILE gets "<name> killed|survived|error<rc>" appended.
Mind -k: it matches substrings ("not fused" also drops "..._are_refused")."""

import contextlib
import io
import os
import sys

sys.path.insert(0, os.getcwd())
os.environ.setdefault("OMP_NUM_THREADS", "1")
import pytest  # noqa: E402

names = [line.strip() for line in open(sys.argv[1]) if line.strip()]
args = ["-x", "-q", "-p", "no:cacheprovider", *sys.argv[3:]]
with open(sys.argv[2], "a") as out:
    for name in names:
        os.environ["MUTANT_UNDER_TEST"] = name
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = int(pytest.main(args))
        print(name, {0: "survived", 1: "killed"}.get(rc, f"error{rc}"), file=out, flush=True)
