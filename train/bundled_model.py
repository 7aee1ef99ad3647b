"""Train the small bundled hybrid model (issue 6): Qwen3.5 architecture, GDN : attention = 3 : 1,
plus one MTP layer, on the Python standard library's own source (every machine has it).

    python train/bundled_model.py --out OUT_DIR                      # on the H200 (fla carried)
    python train/bundled_model.py --out /tmp/x --steps 3 --tiny      # CPU smoke run

Writes an HF-format checkpoint (config.json, safetensors shards <= 15 MB, the MTP head as mtp.*
tensors in mtp.safetensors, tokenizer.json), train/eval losses in train_log.json, and a model card.
The model is transformers' Qwen3_5ForCausalLM (fla's kernels on the GPU when installed); the MTP
head follows Bole's runtime convention (bole/spec/mtp.py): at position p it reads
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

EOS = "<|endoftext|>"


# ----------------------------------------------------------------------------- data

def stdlib_files() -> list[Path]:
    base = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in sorted(glob.glob(str(base / "**" / "*.py"), recursive=True)):
        rel = os.path.relpath(f, base)
        if rel.startswith(("site-packages", "test", "idlelib/idle_test", "lib2to3/tests")) \
                or "/test" in rel:
            continue
        files.append(Path(f))
    return files


def split_modules(files: list[Path], eval_share: int = 20) -> tuple[list[Path], list[Path]]:
    """Whole modules held out: a file goes to eval when hash(top-level module) % eval_share == 0."""
    base = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for f in files:
        top = os.path.relpath(f, base).split(os.sep)[0].removesuffix(".py")
        (held if int(hashlib.sha1(top.encode()).hexdigest(), 16) % eval_share == 0 else train).append(f)
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


def losses(model, mtp, batch: torch.Tensor):
    """(next-token loss, MTP loss) for token windows ``batch [B, T + 1]``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model.model(input_ids=inputs)
    hidden = out.last_hidden_state                           # final-norm hidden states
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    # MTP at positions p = 1 .. T-1: reads embed(x_p) and h_{p-1}, predicts x_{p+1}
    emb = model.model.embed_tokens(inputs[:, 1:])
    T = inputs.shape[1] - 1
    pos = torch.arange(1, T + 1, device=batch.device)[None].expand(batch.shape[0], -1)
    cos_sin = model.model.rotary_emb(emb, pos)
    mask = torch.full((T, T), float("-inf"), device=batch.device).triu(1)[None, None]
    m = mtp(emb, hidden[:, :-1], cos_sin, mask.to(emb.dtype))
    mtp_logits = model.lm_head(m)
    aux = F.cross_entropy(mtp_logits.float().reshape(-1, mtp_logits.shape[-1]),
                          targets[:, 1:].reshape(-1))
    return main, aux


def evaluate(model, mtp, stream: torch.Tensor, seq: int, batches: int, device) -> dict:
    model.eval()
    mains, auxs = [], []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                         enabled=device.type == "cuda"):
        n = (len(stream) - 1) // seq
        for i in range(min(batches, n)):
            w = stream[i * seq: i * seq + seq + 1][None].to(device)
            a, b = losses(model, mtp, w)
            mains.append(float(a))
            auxs.append(float(b))
    model.train()
    loss = sum(mains) / max(1, len(mains))
    return dict(loss=loss, perplexity=math.exp(loss), mtp_loss=sum(auxs) / max(1, len(auxs)))


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--minutes", type=float, default=8.0, help="stop training after this long")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    train_files, held_files = split_modules(stdlib_files())
    if args.tiny:
        train_files, held_files = train_files[:40], held_files[:5]
    train_texts, held_texts = read(train_files), read(held_files)
    tok = train_tokenizer(train_texts, args.vocab if not args.tiny else 512)
    tok.save(str(out / "tokenizer.json"))
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(f"tokens: train {len(train_stream)}, held-out {len(held_stream)} "
          f"({len(held_files)} files)", flush=True)

    from transformers import Qwen3_5ForCausalLM
    config = make_config(tok.get_vocab_size(), tok.token_to_id(EOS), args.tiny)
    model = Qwen3_5ForCausalLM(config).to(device)
    mtp = MTPHead(config).to(device)
    params = list(model.parameters()) + list(mtp.parameters())
    print(f"parameters: model {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M, "
          f"MTP {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(200, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    log = dict(args=vars(args), train=[], eval=[])
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        starts = torch.randint(0, len(train_stream) - args.seq - 2, (args.batch,), generator=gen)
        batch = torch.stack([train_stream[s: s + args.seq + 1] for s in starts]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main_loss, mtp_loss = losses(model, mtp, batch)
            loss = main_loss + args.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            log["train"].append(dict(step=step, loss=float(main_loss.detach()),
                                     mtp_loss=float(mtp_loss.detach()),
                                     seconds=time.time() - t_start))
            print(json.dumps(log["train"][-1]), flush=True)
        if time.time() - t_start > args.minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    log["eval"] = evaluate(model, mtp, held_stream, args.seq, 64 if not args.tiny else 2, device)
    print("held-out:", json.dumps(log["eval"]), flush=True)

    save(model, mtp, out)
    log["held_out_modules"] = sorted({f.name for f in held_files})
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
