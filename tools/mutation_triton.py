"""Mutation testing of a Triton kernel's body, which mutmut leaves alone (it skips decorated
functions): mutmut 3's own operators applied to the ``@triton.jit`` function with its decorator
taken off, the decorator put back; each mutant is loaded in place of the kernel's module and
one test function (a plain or a hypothesis test, called directly) runs against it under the
Triton interpreter (TRITON_INTERPRET=1). Mutants run in batches in one process (no interpreter
start per mutant); a mutant whose out-of-bounds store kills that process is rerun alone and
recorded as ``crash:process`` only if it kills a fresh process too.

    python tools/mutation_triton.py bole/ops/accept/kernel.py _greedy_accept_kernel \\
        tests.speculative.test_accept_device test_fused_greedy_kernel_equals_the_torch_walk \\
        /tmp/m-kernel.tsv

MUTATION_RANGE=a-b runs only mutants a..b. Writes one line a mutant, ``index  status
original -> mutated``: status ``killed`` (an assertion failed), ``crash:<error>`` (the mutant
did not run: a compile or interpreter error, a killed process) or ``survived``. Run it from the
root of a copy of the tree (``git archive HEAD | tar -x -C /tmp/m-kernel``, as
tools/mutation.sh does): it writes the mutants to ``mutation_triton/`` there. Hypothesis does
not shrink (a failure is enough). Needs the ``mutation`` extra."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import traceback


def mutants(path: str, function: str):
    """``(module, [(original node, mutated node)])`` for ``function`` in ``path``, undecorated."""
    from mutmut.mutation.file_mutation import create_mutations
    source = open(path).read()
    bare = source.replace(f"@triton.jit\ndef {function}(", f"def {function}(", 1)
    assert bare != source, f"no '@triton.jit' right above def {function}( in {path}"
    module, found, _, _ = create_mutations(path, bare)
    return module, [m for m in found if m.contained_by_top_level_function is not None
                    and m.contained_by_top_level_function.name.value == function]


def child(path, function, test_module, test_name, out, start, end):
    """Run mutants ``start..end`` (1-based) in this process, appending to ``out``."""
    sys.path.insert(0, os.getcwd())
    from hypothesis import Phase, settings
    importlib.import_module("tests.conftest")               # the repository's profiles
    settings.register_profile("mutation", parent=settings.get_profile("bole"),
                              phases=[Phase.explicit, Phase.generate])
    settings.load_profile("mutation")
    import torch
    test = getattr(importlib.import_module(test_module), test_name)
    module_name = path[:-3].replace("/", ".")
    module, found = mutants(path, function)
    os.makedirs("mutation_triton", exist_ok=True)

    def run(code, name):
        file = f"mutation_triton/{name}.py"
        open(file, "w").write(code)
        spec = importlib.util.spec_from_file_location(module_name, file)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = loaded
        spec.loader.exec_module(loaded)
        torch.manual_seed(0)
        test()

    deco = f"@triton.jit\ndef {function}("
    if start == 1:
        run(module.code.replace(f"def {function}(", deco, 1), "original")   # must pass
    with open(out, "a") as f:
        for i, m in enumerate(found, 1):
            if not start <= i <= end:
                continue
            code = module.deep_replace(m.original_node, m.mutated_node).code
            code = code.replace(f"def {function}(", deco, 1)
            before = module.code_for_node(m.original_node).strip().replace("\n", " ")
            after = module.code_for_node(m.mutated_node).strip().replace("\n", " ")
            try:
                run(code, f"m{i}")
                status = "survived"
            except AssertionError:
                status = "killed"
            except BaseException as e:  # noqa: BLE001  (hypothesis wraps what the test raised)
                text = "".join(traceback.format_exception(e))
                status = "killed" if "AssertionError" in text else f"crash:{type(e).__name__}"
            print(f"{i}\t{status}\t{before[:100]!r} -> {after[:100]!r}", file=f, flush=True)


def main():
    path, function, test_module, test_name, out = sys.argv[1:6]
    if len(sys.argv) > 6:                                   # a child process
        child(path, function, test_module, test_name, out, int(sys.argv[6]), int(sys.argv[7]))
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    total = len(mutants(path, function)[1])
    print(f"{total} mutants of {function}", flush=True)
    open(out, "w").close()
    start, end = 1, total
    if os.environ.get("MUTATION_RANGE"):                    # "a-b": only mutants a..b
        start, end = map(int, os.environ["MUTATION_RANGE"].split("-"))

    def done():
        lines = open(out).read().splitlines()
        return int(lines[-1].split("\t")[0]) if lines else 0

    while start <= end:
        rc = subprocess.call([sys.executable, __file__, *sys.argv[1:6], str(start), str(end)])
        last = done()
        if last == 0 and rc != 0 and start == 1:
            sys.exit("the unmutated kernel fails the test (or the test could not run)")
        if last >= end:
            break
        i = last + 1                                        # the process died at mutant i?
        if rc != 0:
            alone = subprocess.call([sys.executable, __file__, *sys.argv[1:6], str(i), str(i)])
            if done() < i:                                  # it kills a fresh process too
                with open(out, "a") as f:
                    print(f"{i}\tcrash:process(rc={alone})\tsee mutation_triton/m{i}.py", file=f)
        start = i + 1


if __name__ == "__main__":
    main()
