#!/usr/bin/env python3
"""PyTorch side of `scripts/bench-vs-torch.sh`: kiln's default GPT-2, trained the same way, eager.

The model is the shape of kiln's default recipe (crates/train/src/default_recipe.toml, built by
models/gpt2): 2 layers, 4 heads, d=64, context 64, vocabulary 256 (kiln's byte tokenizer), GELU
tanh ("gelu_new"), LayerNorm eps 1e-5 with bias, biases on every Linear, fused QKV, the head tied
to the token embedding, attention written out (scores, causal mask, softmax, @V) as kiln does:
120,576 parameters. Training: AdamW (betas 0.9/0.99, eps 1e-5 as Burn's default, weight decay
0.01), linear warmup then cosine decay, global-norm clipping at 1.0, 16 x 64 = 1024 tokens per
step over all ranks (each of N ranks takes 16/N rows), the loss averaged over ranks every step
(kiln logs it that way), random windows of a synthetic byte corpus. No torch.compile.

Modes:
  single  one process, torch threads = --threads (default: all cores)
  ddp     --nproc processes, DistributedDataParallel over gloo
  fsdp    --nproc processes, FSDP2 (torch.distributed.fsdp.fully_shard: each block, then the
          root) over gloo; FSDP1 (FullyShardedDataParallel, FULL_SHARD) only if fully_shard is
          missing, and the result line says which

It installs nothing and starts its own processes (torch.multiprocessing, a free port). Timing
starts after --warmup steps (all ranks at a barrier) and ends after --steps more. The last line
is machine-readable:
  RESULT mode=ddp impl=DDP world=2 threads=1 steps=200 tokens_per_step=1024 seconds=... tokens_per_s=...
"""

import argparse
import contextlib
import math
import os
import sys
import time
import warnings

from common import free_port

# A torch wheel without NumPy warns at import; nothing here uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


class Attention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask[:, :, :t, :t]
        y = F.softmax(scores, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = Mlp(d)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    def __init__(self, layers, heads, dim, context):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=1e-5)
        # kiln's causal mask: 0 where a position may attend, f32::MIN above the diagonal.
        mask = torch.triu(torch.full((context, context), torch.finfo(torch.float32).min), 1)
        self.register_buffer("mask", mask.view(1, 1, context, context), persistent=False)
        for m in self.modules():  # kiln: N(0, 0.02) for embeddings and Linears, biases too
            if isinstance(m, (nn.Linear, nn.Embedding)):
                for p in m.parameters():
                    nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, self.mask)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()  # the head tied to wte


def lr_at(step, a):
    """kiln's schedule: linear warmup to lr, cosine decay to lr * min_lr_ratio (steps from 1)."""
    if step <= a.lr_warmup:
        return a.lr * step / a.lr_warmup
    total = a.warmup + a.steps
    progress = min(1.0, (step - a.lr_warmup) / max(1, total - a.lr_warmup))
    low = a.lr * a.min_lr_ratio
    return low + (a.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shard_fsdp(model):
    """FSDP2 when available (each block, then the root: wte, wpe, ln_f and the tied head)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            fully_shard = None
    if fully_shard is not None:
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        return model, "FSDP2(fully_shard)"
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    print("fully_shard is not available in this torch: falling back to FSDP1", flush=True)
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD), "FSDP1(FULL_SHARD)"


def worker(rank, world, a, port):
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist = None
    if a.mode != "single":
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(a.seed)  # the same initial weights on every rank
    model = Gpt2(a.layers, a.heads, a.dim, a.context).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    impl = "eager"
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, impl = DDP(model), "DDP"
    elif a.mode == "fsdp":
        model, impl = shard_fsdp(model)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=a.lr,
        betas=(a.beta1, a.beta2),
        eps=1e-5,
        weight_decay=a.weight_decay,
    )

    g = torch.Generator().manual_seed(a.seed)
    corpus = torch.randint(0, VOCAB, (a.corpus,), generator=g)
    rows = a.batch_size // world
    span = a.corpus - a.seq_len - 1
    offsets = torch.arange(a.seq_len + 1)

    def autocast():
        if a.autocast == "f32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if a.autocast == "bf16" else torch.float16
        return torch.autocast(device_type=a.device.split(":")[0], dtype=dtype)

    def step_once(step):
        # Every rank draws the global batch's starts (as kiln) and takes its rows.
        starts = torch.randint(0, span + 1, (a.batch_size,), generator=g)[rank * rows:(rank + 1) * rows]
        win = corpus[starts[:, None] + offsets].to(a.device)
        x, y = win[:, :-1], win[:, 1:]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a)
        with autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        loss = loss.detach()
        if dist is not None:
            dist.all_reduce(loss)
            loss /= world
        return loss.item(), norm

    if rank == 0:
        print(
            f"torch {torch.__version__}: gpt2 {n_params} parameters, {a.mode} ({impl}) on {world} "
            f"process(es), {a.threads} thread(s) each, {a.batch_size * a.seq_len} tokens per step, "
            f"device {a.device}",
            flush=True,
        )
    step = 0
    for _ in range(a.warmup):
        step += 1
        loss, _ = step_once(step)
    if dist is not None:
        dist.barrier()
    t0 = time.perf_counter()
    first = None
    for _ in range(a.steps):
        step += 1
        loss, _ = step_once(step)
        first = loss if first is None else first
    if dist is not None:
        dist.barrier()
    secs = time.perf_counter() - t0
    if rank == 0:
        tps = a.steps * a.batch_size * a.seq_len / secs
        print(f"loss {first:.4f} -> {loss:.4f}; {a.steps} timed steps in {secs:.2f} s", flush=True)
        print(
            f"RESULT device={a.device} autocast={a.autocast} mode={a.mode} impl={impl} world={world} threads={a.threads} steps={a.steps} "
            f"tokens_per_step={a.batch_size * a.seq_len} seconds={secs:.3f} tokens_per_s={tps:.1f}",
            flush=True,
        )
    if dist is not None:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["single", "ddp", "fsdp"], default="single")
    p.add_argument("--nproc", type=int, default=2, help="processes for ddp/fsdp")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0: cores for single, max(1, cores/nproc) otherwise)")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step over all ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup", type=int, default=30)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--corpus", type=int, default=262144, help="synthetic corpus bytes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--autocast", choices=["f32", "bf16", "f16"], default="f32",
                   help="torch.autocast dtype of forward and loss (f16 without a GradScaler: timing only)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the model and batches (single mode): cpu or cuda")
    a = p.parse_args()
    if a.device != "cpu" and a.mode != "single":
        sys.exit("--device other than cpu is for --mode single")
    cores = os.cpu_count() or 1
    world = 1 if a.mode == "single" else a.nproc
    if a.batch_size % world:
        sys.exit(f"--batch-size {a.batch_size} is not divisible by {world} processes")
    if a.threads <= 0:
        a.threads = cores if world == 1 else max(1, cores // world)
    if world == 1:
        worker(0, 1, a, 0)
    else:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=(world, a, free_port()), nprocs=world, join=True)


if __name__ == "__main__":
    main()
