"""The ``bole`` command line."""

from __future__ import annotations

import argparse
import sys

from bole.config import GDN_SHAPES


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bole", description="Exact tree speculative decoding "
                                     "for hybrid-attention (Gated DeltaNet) LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="verify random draft trees on one GDN layer of a real "
                          "model's shape and print agreement and memory figures")
    demo.add_argument("--shape", default="qwen3.5-9b", choices=sorted(GDN_SHAPES),
                      help="model whose GDN layer shape to use (default: qwen3.5-9b)")
    demo.add_argument("--nodes", type=int, nargs="+", default=[64, 128],
                      help="tree sizes to verify (default: 64 128)")
    demo.add_argument("--depth", type=int, default=8, help="maximum tree depth (default: 8)")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from bole import demo
        if any(n < 1 for n in args.nodes) or args.depth < 0:
            print("bole demo: --nodes must be >= 1 and --depth >= 0", file=sys.stderr)
            return 2
        demo.main(args.shape, tuple(args.nodes), args.depth, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
