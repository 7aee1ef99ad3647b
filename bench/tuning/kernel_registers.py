"""Registers and spills of the verification kernel for the H200 (sm_90), compiled on a machine
without a GPU.

Triton compiles to a cubin with its bundled ptxas on any machine; ``cuobjdump -res-usage`` then
reports registers per thread and the spill stack. The launch is specialised as on the device
(pointers and strides divisible by 16, unit strides as constants), so with the device's Triton
version the counts match the compiled kernel there (checked: 242 registers for BV = 128 / 8 warps,
as ncu reported on the H200). Use the device's version:

    python -m pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36 python bench/tuning/kernel_registers.py [--model qwen3.5-9b] [--block-nodes 64]

A ``stack`` above zero is spilled registers (bytes per thread, in local memory).

``--sass`` also reads the compiled code, which is where the fourth session's two gains were found
(bench/NOTES.md, items 10 and 13): the number of sm_90 SASS instructions (static: each loop body
counted once), the length of every loop body, and the ``ttg.convert_layout`` ops that Triton left
inside loops in the TTGIR (a conversion of a loop-invariant tile in there is redone every step).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run by path, Python puts bench/tuning/ first on sys.path: drop it, so that bench's modules are
# reached as bench.<name> and never shadow, or are shadowed by, an installed package of that name.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() not in (ROOT, ROOT / "bench" / "tuning")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench import harness as kb  # noqa: E402  (bench/harness.py: the VerifyConfig switch flags)

from bole.config import gdn_shape  # noqa: E402
from bole.ops.gdn.verify import kernel as tv  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*bf16",
            "beta_ptr": "*bf16", "A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32",
            "state_ptr": "*fp32", "state_idx_ptr": "*i32", "cu_ptr": "*i32", "mask_ptr": "*u8",
            "o_ptr": "*bf16", "u_ptr": "*fp32", "L_ptr": "*fp64", "kinv_ptr": "*fp32"}
UNIT_STRIDES = ("s_gh", "s_bh", "s_sv")      # contiguous last dims: Triton specialises 1 away


def compile_verify(shape, block_nodes: int, cfg: tv.VerifyConfig):
    """The verification kernel compiled for sm_90 as bench/harness.py launches it with ``cfg``
    (bf16, raw gates, in-kernel l2 norm, tf32, depth-8 trees)."""
    fn = tv._tree_gdn_verify_kernel
    names = fn.arg_names
    const = dict(H_V=shape.num_v_heads, H_K=shape.num_k_heads,
                 GROUP=shape.num_v_heads // shape.num_k_heads, D_K=shape.head_k_dim,
                 D_V=shape.head_v_dim, BT=block_nodes, BK=cfg.BK, BV=cfg.BV,
                 RAW_GATES=True, L2NORM=True, PREC="tf32",
                 **tv.kernel_switches(cfg, dtype=torch.bfloat16, precision="tf32", raw_gates=True,
                                      l2norm=True, max_depth=kb.DEPTH, interpret=False,
                                      d_k=shape.head_k_dim),
                 **{n: 1 for n in UNIT_STRIDES})
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in POINTERS:
            signature[n] = POINTERS[n]
        elif n in const:
            signature[n] = "constexpr"
        elif n == "scale":
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
        if n in POINTERS or (n.startswith("s_") and n not in UNIT_STRIDES):
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(names.index(k),): v for k, v in const.items() if k in names}
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump <flag>`` of the compiled cubin (Triton's bundled tool), as text."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def resource_usage(compiled) -> dict:
    """registers, stack (spill bytes), static shared memory per thread/block from the cubin."""
    out = cuobjdump(compiled, "-res-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out)
    if not m:
        raise RuntimeError(f"unexpected cuobjdump output:\n{out}")
    return dict(registers=int(m[1]), stack_bytes=int(m[2]), static_shared=int(m[3]),
                dynamic_shared=compiled.metadata.shared)


def sass_lines(compiled) -> list[str]:
    """The cubin's sm_90 SASS, one instruction per entry (``cuobjdump -sass``)."""
    return [ln.strip() for ln in cuobjdump(compiled, "-sass").splitlines()
            if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]


def sass_source_lines(compiled) -> list[tuple[str, int, str | None]]:
    """``(opcode, line, file)`` of every SASS instruction in code order, the line being the
    innermost inlined source line that nvdisasm's line table gives it (``(op, 0, None)`` where it
    gives none)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([str(tool), "-gi", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    out, where = [], (0, None)
    for ln in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            where = (int(m.group(2)), Path(m.group(1)).name)
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", ln)
        if m:
            out.append((m.group(1), *where))
    return out


def sass_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first instruction, body length) of every loop: every backward branch, in code order."""
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) // 16 < i:
            start = int(m.group(1), 16) // 16          # SASS instructions are 16 bytes on sm_90
            loops.append((start, i + 1 - start))
    return loops


def converts_in_loops(ttgir: str) -> int:
    """``ttg.convert_layout`` ops inside ``scf.for`` bodies of the TTGIR."""
    stack, count = [], 0
    for ln in ttgir.splitlines():
        t = ln.strip()
        if t.startswith("}"):
            if stack:
                stack.pop()
            if t.rstrip().endswith("{"):               # "} else {"
                stack.append(stack[-1] if stack else "if")
            continue
        if "ttg.convert_layout" in t and "for" in stack:
            count += 1
        if t.endswith("{"):
            stack.append("for" if " scf.for " in f" {t}" else "other")
    return count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--block-nodes", type=int, default=64)
    ap.add_argument("--bv", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--bk", nargs="+", type=int, default=[32])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--maxnreg", nargs="+", type=int, default=[0], help="0: no register cap")
    ap.add_argument("--stages", nargs="+", type=int, default=None,
                    help="num_stages (default: CONFIG_TABLE's for the block)")
    kb.add_switch_args(ap)
    ap.add_argument("--sass", action="store_true",
                    help="also SASS instructions, loop bodies and layout conversions in loops")
    args = ap.parse_args(argv)
    shape = gdn_shape(args.model)
    print(f"triton {triton.__version__}, {shape.name}, BT = {args.block_nodes}")
    table = tv.CONFIG_TABLE[next((b for b in sorted(tv.CONFIG_TABLE) if b >= args.block_nodes),
                                 max(tv.CONFIG_TABLE))]
    stages = args.stages or [table.num_stages]
    print(f"{'BV':>4} {'BK':>4} {'warps':>5} {'st':>3} {'cap':>4} {'regs':>5} {'spill B':>8} "
          f"{'smem B':>7}" + ("  SASS  loops (start+length)  converts in loops" if args.sass else "")
          + "  switches on")
    base = [tv.VerifyConfig(BV=bv, BK=bk, num_warps=nw, num_stages=st,
                            split_gram=args.block_nodes >= 256, maxnreg=cap or None)
            for bv, bk, nw, st, cap in itertools.product(args.bv, args.bk, args.warps, stages,
                                                         args.maxnreg)]
    for cfg in kb.with_switches(base, args):
        compiled = compile_verify(shape, args.block_nodes, cfg)
        use = resource_usage(compiled)
        line = (f"{cfg.BV:>4} {cfg.BK:>4} {cfg.num_warps:>5} {cfg.num_stages:>3} "
                f"{cfg.maxnreg or '-':>4} {use['registers']:>5} {use['stack_bytes']:>8} "
                f"{use['dynamic_shared']:>7}")
        if args.sass:
            lines = sass_lines(compiled)
            loops = " ".join(f"{a}+{n}" for a, n in sass_loops(lines))
            line += f"  {len(lines):>4}  {loops}  {converts_in_loops(compiled.asm['ttgir'])}"
        on = [name for name in kb.config_switches() if getattr(cfg, name)]
        print(line + "  " + (" ".join(on) or "-"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
