"""The small-scale proxy of attention-logit growth (Wortsman et al. 2023, arXiv 2309.14322): a
2-layer, 4-head causal transformer (width 128, 64 tokens, AdamW) trained at a high learning rate
sees its largest attention logits grow geometrically while its loss stops improving; with
qk-layernorm, or at a low learning rate, they stay small. Each run is watched by attncheck.watch
and read by `attncheck watch`, which must raise logit_growth on the first run only.

    python examples/logit_growth.py [OUTDIR] [--steps N]
    attncheck watch OUTDIR/lr0.1.jsonl --fail-on logit_growth --plot OUTDIR/lr0.1.png   # exit 1
"""

import argparse
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import output_dir

import attncheck


class Block(nn.Module):
    def __init__(self, d: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.q_norm = nn.LayerNorm(d // heads) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(d // heads) if qk_norm else nn.Identity()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=-1)
        )
        a = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)  # (B, H, T, d/H)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=128, d=128, heads=4, layers=2, seq=64, qk_norm=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, qk_norm) for _ in range(layers))
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.out(self.ln(x))


def train(log, lr: float, qk_norm: bool, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM(qk_norm=qk_norm)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.randint(0, 128, (8, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    with attncheck.watch(model, log=log) as w:
        for _ in range(steps):
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 128), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss.item())
            losses.append(loss.item())
    return losses


RUNS = {"lr0.1": (0.1, False), "lr0.1-qknorm": (0.1, True), "lr0.003": (3e-3, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    out = output_dir()
    for name, (lr, qk_norm) in RUNS.items():
        log = out / f"{name}.jsonl"
        losses = train(log, lr, qk_norm, args.steps)
        cmd = [sys.executable, "-m", "attncheck", "watch", str(log), "--fail-on", "logit_growth", "--quiet"]
        if name == "lr0.1":
            cmd += ["--plot", str(out / f"{name}.png")]
        print(
            f"== {name}: loss {losses[0]:.3f} -> {min(losses):.3f} (lowest) -> {losses[-1]:.3f}; $ attncheck watch "
            f"{log.name} --fail-on logit_growth",
            flush=True,
        )
        rc = subprocess.run(cmd).returncode
        want = 1 if name == "lr0.1" else 0
        if rc != want:
            sys.exit(f"{name}: attncheck watch exited {rc}, expected {want}")


if __name__ == "__main__":
    main()
