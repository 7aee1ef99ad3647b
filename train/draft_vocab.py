"""Count a checkpoint's tokens over a corpus: the ``token_counts.json`` that a reduced draft
vocabulary (``--draft-vocab N``, bole/speculative/drafters/draft_vocab.py) ranks tokens by.

    python train/draft_vocab.py --model CHECKPOINT --corpus FILE [FILE ...]
    python train/draft_vocab.py --bundled       # the bundled model: its training split of the
                                                # standard library (train/bundled_model.py)

Writes ``CHECKPOINT/token_counts.json`` (``--out`` elsewhere) with the counts, the corpus and the
date, and prints how much of the held-out split the most frequent N tokens cover (``--bundled``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bole.assets import BUNDLED_MODEL  # noqa: E402
from bole.speculative.drafters.draft_vocab import COUNTS_FILE, frequent_ids  # noqa: E402


def count(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.long(), minlength=vocab)[:vocab]


def coverage(counts: torch.Tensor, held: torch.Tensor, sizes) -> dict[int, float]:
    """Share of the held-out tokens inside the ``size`` most frequent tokens of ``counts``."""
    held_counts = count(held, counts.numel())
    total = max(1, int(held_counts.sum()))
    return {n: int(held_counts[frequent_ids(counts, n)].sum()) / total for n in sizes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint folder (tokenizer.json)")
    src.add_argument("--bundled", action="store_true",
                     help="the bundled model over its own training split")
    ap.add_argument("--corpus", nargs="+", default=[], help="text files to count")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--out", default=None, help=f"default: MODEL/{COUNTS_FILE}")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer
    folder = Path(args.model) if args.model else BUNDLED_MODEL
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    held = None
    if args.bundled:
        sys.path.insert(0, str(ROOT / "train"))
        import bundled_model as bm                 # its corpus split and tokenisation
        train_files, held_files = bm.split_modules(bm.stdlib_files())
        ids = bm.token_stream(tok, bm.read(train_files))
        held = bm.token_stream(tok, bm.read(held_files))
        source = (f"the bundled model's training split of this Python's standard library "
                  f"({len(train_files)} files, {ids.numel()} tokens; train/bundled_model.py)")
    elif args.corpus:
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.corpus]
        ids = torch.tensor([t for enc in tok.encode_batch(texts) for t in enc.ids])
        source = f"{len(texts)} files: " + ", ".join(Path(f).name for f in args.corpus[:8])
    else:
        ap.error("give --corpus FILES or --bundled")
    counts = count(ids, vocab)
    out = Path(args.out) if args.out else folder / COUNTS_FILE
    record = dict(source=source, date=datetime.date.today().isoformat(),
                  tokens=int(counts.sum()), counts=counts.tolist())
    if held is not None:
        record["held_out_coverage"] = coverage(counts, held, args.sizes)
        for n, c in record["held_out_coverage"].items():
            print(f"the {n} most frequent tokens cover {100 * c:.1f}% of the held-out tokens")
    out.write_text(json.dumps(record))
    print(f"wrote {out} ({record['tokens']} tokens counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
