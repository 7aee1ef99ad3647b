"""Train the small bundled hybrid model (issue 6): Qwen3.5 architecture, GDN : attention = 3 : 1,
plus one MTP layer, on the Python standard library's own source (every machine has it).

    python train/bundled_model.py --out OUT_DIR                      # on the H200 (fla carried)
    python train/bundled_model.py --out /tmp/x --steps 3 --tiny      # CPU smoke run

Writes an HF-format checkpoint (config.json, safetensors shards <= 15 MB, the MTP head as mtp.*
tensors in mtp.safetensors, tokenizer.json), train/eval losses in train_log.json, and a model card.
The model is transformers' Qwen3_5ForCausalLM (fla's kernels on the GPU when installed); the MTP
head follows Bole's runtime convention (bole/speculative/drafters/mtp.py): at position p it reads
[norm(embed(x_p)) | norm(h_{p-1})] and predicts x_{p+1}, with h the final-norm hidden state.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("BOLE_BLOCK_FLA"):           # fall back to transformers' torch GDN code
    sys.modules["fla"] = None

EOS = "<|endoftext|>"


# ----------------------------------------------------------------------------- data

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _rel(f: Path) -> list[str]:
    return os.path.relpath(f, STDLIB).split(os.sep)


def is_test(f: Path) -> bool:
    parts = _rel(f)
    return parts[0] == "test" or any(p in ("tests", "idle_test") for p in parts)


def module_key(f: Path) -> str:
    """The module a file belongs to: its top-level package, or for test/test_X the tested module X
    (so that a held-out module's own tests are held out with it)."""
    parts = _rel(f)
    if parts[0] == "test" and len(parts) > 1:
        return parts[1].removesuffix(".py").removeprefix("test_")
    return parts[0].removesuffix(".py")


def stdlib_files(tests: bool = True) -> list[Path]:
    """The standard library's own .py files (its test suite too when ``tests`` and installed)."""
    files = []
    for f in sorted(glob.glob(str(STDLIB / "**" / "*.py"), recursive=True)):
        f = Path(f)
        if _rel(f)[0] == "site-packages" or (not tests and is_test(f)):
            continue
        files.append(f)
    return files


def split_modules(files: list[Path], eval_share: int = 20) -> tuple[list[Path], list[Path]]:
    """Whole modules held out: a file goes to eval when sha1(module_key) % eval_share == 0."""
    train, held = [], []
    for f in files:
        key = module_key(f)
        (held if int(hashlib.sha1(key.encode()).hexdigest(), 16) % eval_share == 0 else train).append(f)
    return train, held


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def corpus(args):
    """(tokenizer, train stream, held-out stream, held-out file names), built from this machine's
    standard library, or loaded from ``args.data`` when a previous run prepared it there (so that a
    machine whose Python lacks the test suite trains on the same corpus)."""
    from tokenizers import Tokenizer
    cache = Path(args.data) / "corpus.pt" if args.data else None
    if cache is not None and cache.is_file():
        d = torch.load(cache)
        return (Tokenizer.from_str(d["tokenizer"]), d["train"].long(), d["held"].long(),
                d["held_files"])
    train_files, held_files = split_modules(stdlib_files())
    if args.tiny:
        train_files, held_files = train_files[:40], held_files[:5]
    train_texts, held_texts = read(train_files), read(held_files)
    tok = train_tokenizer(train_texts, args.vocab if not args.tiny else 512)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    held_names = [os.path.relpath(f, STDLIB) for f in held_files]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(tokenizer=tok.to_str(), train=train_stream.to(torch.int16),
                        held=held_stream.to(torch.int16), held_files=held_names,
                        python=sys.version), cache)
    return tok, train_stream, held_stream, held_names


# ----------------------------------------------------------------------------- model

def make_config(vocab_size: int, eos_id: int, tiny: bool):
    from transformers import Qwen3_5TextConfig
    size = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32) if tiny \
        else dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    n = size["num_hidden_layers"]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=4096,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        eos_token_id=eos_id, bos_token_id=eos_id, mtp_num_hidden_layers=1, **size)


class MTPHead(torch.nn.Module):
    """One MTP layer with Bole's runtime tensor names (mtp.*), trained alongside the model.

    The decoder layer is transformers' own (gated attention, q/k norm, partial rotary, MLP) so
    the math equals the runtime's; only the fusion (fc over two normalised inputs) is ours.
    """

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,
                                                                 Qwen3_5RMSNorm)
        import copy
        c = copy.deepcopy(config)
        c.layer_types = ["full_attention"]
        H = config.hidden_size
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(c, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, emb_next, hidden, position_embeddings, attention_mask):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.norm(x)


def losses(model, mtp, batch: torch.Tensor, mtp_steps: int = 1):
    """(next-token loss, [MTP loss of step 1 .. mtp_steps]) for token windows ``batch [B, L + 1]``.

    MTP step 1 at position p reads embed(x_p) and the target's h_{p-1} and predicts x_{p+1}; step
    k > 1 reads embed(x_p) and step k-1's own output at p - 1 and predicts x_{p+1} — exactly how the
    drafter chains the head for deeper tree nodes (bole/speculative/drafters/mtp.py).
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model.model(input_ids=inputs, use_cache=False)
    hidden = out.last_hidden_state                           # final-norm hidden states
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    L = inputs.shape[1]
    prev, aux = hidden, []
    for k in range(1, mtp_steps + 1):
        emb = model.model.embed_tokens(inputs[:, k:])         # positions p = k .. L-1
        T = L - k
        pos = torch.arange(k, L, device=batch.device)[None].expand(batch.shape[0], -1)
        cos_sin = model.model.rotary_emb(emb, pos)
        mask = torch.full((T, T), float("-inf"), device=batch.device).triu(1)[None, None]
        prev = mtp(emb, prev[:, :-1], cos_sin, mask.to(emb.dtype))
        mtp_logits = model.lm_head(prev)
        aux.append(F.cross_entropy(mtp_logits.float().reshape(-1, mtp_logits.shape[-1]),
                                   targets[:, k:].reshape(-1)))
    return main, aux


def evaluate(model, mtp, stream: torch.Tensor, seq: int, batches: int, device,
             mtp_steps: int) -> dict:
    """Held-out loss and perplexity of the model, and the loss of each MTP step."""
    model.eval()
    mains, auxs = [], []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=device.type == "cuda"):
        n = (len(stream) - 1) // seq
        for i in range(min(batches, n)):
            w = stream[i * seq: i * seq + seq + 1][None].to(device)
            a, b = losses(model, mtp, w, mtp_steps)
            mains.append(float(a))
            auxs.append([float(x) for x in b])
    model.train()
    loss = sum(mains) / max(1, len(mains))
    steps = [sum(a[k] for a in auxs) / max(1, len(auxs)) for k in range(mtp_steps)]
    return dict(loss=loss, perplexity=math.exp(loss), mtp_loss_per_step=steps)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.5,
                    help="weight of the mean MTP loss over its steps")
    ap.add_argument("--mtp-steps", type=int, default=3,
                    help="chained MTP steps trained (the drafter chains the head up to the depth)")
    ap.add_argument("--minutes", type=float, default=8.0,
                    help="wall-clock budget of the whole run; the cosine schedule follows whichever "
                         "of steps or time runs out first")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None,
                    help="corpus cache folder: loaded when it holds corpus.pt, else written there")
    ap.add_argument("--prepare-only", action="store_true", help="build the corpus cache and stop")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    tok, train_stream, held_stream, held_names = corpus(args)
    tok.save(str(out / "tokenizer.json"))
    print(f"tokens: train {len(train_stream)}, held-out {len(held_stream)} "
          f"({len(held_names)} files)", flush=True)
    if args.prepare_only:
        return 0

    from transformers import Qwen3_5ForCausalLM
    config = make_config(tok.get_vocab_size(), tok.token_to_id(EOS), args.tiny)
    model = Qwen3_5ForCausalLM(config).to(device)
    mtp = MTPHead(config).to(device)
    params = list(model.parameters()) + list(mtp.parameters())
    print(f"parameters: model {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M, "
          f"MTP {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(200, args.steps // 10))
    deadline = t_start + args.minutes * 60 - 45        # leave time for evaluation and saving
    t_train = time.time()

    def lr_at(step: int) -> float:
        progress = max(step / max(1, args.steps),
                       (time.time() - t_train) / max(1.0, deadline - t_train))
        return args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    log = dict(args=vars(args), train=[], eval=[])
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        starts = torch.randint(0, len(train_stream) - args.seq - 2, (args.batch,), generator=gen)
        batch = torch.stack([train_stream[s: s + args.seq + 1] for s in starts]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main_loss, mtp_losses = losses(model, mtp, batch, args.mtp_steps)
            loss = main_loss + args.mtp_weight * sum(mtp_losses) / len(mtp_losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        last = step == args.steps - 1 or time.time() > deadline
        if step % 50 == 0 or last:
            log["train"].append(dict(step=step, loss=float(main_loss.detach()),
                                     mtp_loss_per_step=[float(x.detach()) for x in mtp_losses],
                                     lr=lr_at(step), seconds=time.time() - t_start))
            print(json.dumps(log["train"][-1]), flush=True)
        if last:
            if step < args.steps - 1:
                print(f"time limit reached at step {step}", flush=True)
            break
    log["eval"] = evaluate(model, mtp, held_stream, args.seq, 64 if not args.tiny else 2, device,
                           args.mtp_steps)
    print("held-out:", json.dumps(log["eval"]), flush=True)

    save(model, mtp, out)
    log["held_out_files"] = held_names
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    return 0


def save(model, mtp, out: Path) -> None:
    """HF checkpoint in bf16 (shards <= 15 MB) plus mtp.safetensors, with one index for both."""
    from safetensors.torch import save_file
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="15MB")
    mtp_tensors = {f"mtp.{n}": p.detach().to(torch.bfloat16).cpu().contiguous()
                   for n, p in mtp.state_dict().items()}
    save_file(mtp_tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    index_file = out / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        from safetensors import safe_open
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in f.keys()}}
    index["weight_map"].update({n: "mtp.safetensors" for n in mtp_tensors})
    index_file.write_text(json.dumps(index, indent=1))


if __name__ == "__main__":
    sys.exit(main())
