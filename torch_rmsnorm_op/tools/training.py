"""Training with the ops: the tutorial's integration run and a tiny GPT with bit-exact resume.

``train_integration``: Linear -> RMSNorm -> SiLU -> Linear on synthetic data
(train/validation/test), the reference path (PyTorch's ``nn.RMSNorm``) and the
kernel path (``torch_rmsnorm_op.RMSNorm``) from the same initialization,
100 Adam steps of 32 examples, save and reload, counters proving the kernel
path ran.

``train_tiny_gpt``: ``TinyLlama`` (patched: every RMSNorm on our ops) under
``torch.compile``, AdamW, gradient accumulation over micro-batches (averaged,
one optimizer step, zeroed), one JSON line per step in ``OUT/loss.jsonl``.
Checkpoints hold the weights, the optimizer moments, the step, the data
position and the RNG states; SIGTERM writes one and exits, SIGUSR1 writes one
and continues, both at the end of the step in flight; ``resume=True`` continues
from ``OUT/checkpoint.pt`` so that the loss sequence is bit-identical to an
uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_rmsnorm_op as T


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- integration


def _mlp(norm: type[nn.Module], width: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), norm(hidden, eps=1e-6), nn.SiLU(), nn.Linear(hidden, 1))


def train_integration(steps: int = 100, batch: int = 32, width: int = 16, hidden: int = 64,
                      out_dir: str = "outputs/integration", seed: int = 0) -> dict:
    """Train the reference and kernel paths side by side; returns (and prints) the comparison."""
    device = _device()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, width, generator=gen)
    y = (x[:, :4].sum(-1, keepdim=True).sin() + 0.1 * torch.randn(4096, 1, generator=gen))
    x, y = x.to(device), y.to(device)
    split = {"train": slice(0, 3072), "validation": slice(3072, 3584), "test": slice(3584, 4096)}

    torch.manual_seed(seed)
    reference = _mlp(nn.RMSNorm, width, hidden).to(device)
    kernel = _mlp(T.RMSNorm, width, hidden).to(device)
    kernel.load_state_dict(reference.state_dict())  # the same initialization

    xb, yb = x[split["train"]][:batch], y[split["train"]][:batch]
    outs, grads = [], []
    for model in (reference, kernel):
        out = model(xb)
        nn.functional.mse_loss(out, yb).backward()
        outs.append(out.detach())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    initial_output_diff = (outs[0] - outs[1]).abs().max().item()
    initial_grad_diff = max((a - b).abs().max().item() for a, b in zip(*grads))

    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (reference, kernel)]
    order = torch.randperm(3072, generator=torch.Generator().manual_seed(seed + 1))
    T.reset_dispatch_stats()
    for step in range(steps):
        idx = order[(step * batch) % 3072:][:batch].to(device)
        for model, opt in zip((reference, kernel), opts):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    counters = T.dispatch_stats()

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "kernel_path.pt")
    torch.save(kernel.state_dict(), path)
    reloaded = _mlp(T.RMSNorm, width, hidden).to(device)
    reloaded.load_state_dict(torch.load(path))
    with torch.no_grad():
        xt, yt = x[split["test"]], y[split["test"]]
        reload_error = (reloaded(xt) - kernel(xt)).abs().max().item()
        mse = {name: nn.functional.mse_loss(m(xt), yt).item() for name, m in
               (("reference", reference), ("kernel", kernel))}
        val = {name: nn.functional.mse_loss(m(x[split["validation"]]), y[split["validation"]]).item()
               for name, m in (("reference", reference), ("kernel", kernel))}
    result = {
        "device": device, "steps": steps, "batch": batch,
        "initial_output_max_abs_diff": initial_output_diff, "initial_grad_max_abs_diff": initial_grad_diff,
        "kernel_forwards": counters["kernel"].get("rmsnorm.fwd", 0),
        "kernel_backwards": counters["kernel"].get("rmsnorm.bwd", 0),
        "fallbacks": counters["fallback"], "reload_max_abs_error": reload_error,
        "validation_mse": val, "test_mse": mse,
    }
    print(f"device {device}; {steps} Adam steps of {batch}")
    print(f"initial |output diff| {initial_output_diff:.3e}, |grad diff| {initial_grad_diff:.3e}")
    print(f"kernel path ran {result['kernel_forwards']} forwards and {result['kernel_backwards']} backwards "
          f"(fallbacks: {counters['fallback'] or 'none'})")
    print(f"reload max |error| {reload_error}")
    print(f"{'':<10} {'validation MSE':>15} {'test MSE':>10}")
    for name in ("reference", "kernel"):
        print(f"{name:<10} {val[name]:>15.6f} {mse[name]:>10.6f}")
    return result


# ----------------------------------------------------------------------------- tiny GPT


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    dim: int = 32
    depth: int = 2
    heads: int = 2
    seq: int = 16
    micro_batch: int = 4
    accumulation: int = 2
    lr: float = 3e-3


def corpus(length: int = 1 << 16, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """A synthetic corpus with structure to learn: a fixed random order-2 Markov chain."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab, 3), generator=gen).tolist()
    choice = torch.randint(0, 3, (length,), generator=gen).tolist()
    tokens = [1, 2]
    for i in range(2, length):
        tokens.append(table[tokens[i - 2]][tokens[i - 1]][choice[i]])
    return torch.tensor(tokens)


def _batch(data: torch.Tensor, position: int, cfg: GPTConfig) -> torch.Tensor:
    """Micro-batch number ``position``: deterministic, so the data position is just a counter."""
    span = cfg.seq + 1
    starts = (torch.arange(cfg.micro_batch) + position * cfg.micro_batch) * span % (len(data) - span)
    return torch.stack([data[s:s + span] for s in starts.tolist()])


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def train_tiny_gpt(steps: int, out_dir: str, resume: bool = False, backend: str = "inductor",
                   logdir: str | None = "runs/tiny_gpt", cfg: GPTConfig = GPTConfig()) -> list[float]:
    """Train (or resume) for ``steps`` optimizer steps in total; returns this process's losses.

    For bit-exact resume it switches the process to deterministic algorithms
    (``torch.use_deterministic_algorithms(True, warn_only=True)``) and keeps that setting.
    """
    from torch_rmsnorm_op.tools.toy_models import TinyLlama

    device = _device()
    # Bit-exact resume needs run-to-run determinism everywhere, not only in our kernels:
    # Inductor otherwise emits atomic scatter-adds (the tied embedding's gradient).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.makedirs(out_dir, exist_ok=True)
    ckpt_path = os.path.join(out_dir, "checkpoint.pt")
    loss_path = os.path.join(out_dir, "loss.jsonl")
    torch.manual_seed(0)
    random.seed(0)
    model = TinyLlama(cfg.vocab, cfg.dim, cfg.depth, cfg.heads).to(device)
    T.patch_rmsnorm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step, position = 0, 0
    if resume:
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, position = ckpt["step"], ckpt["data_position"]
        _set_rng_state(ckpt["rng"])
    elif os.path.exists(loss_path):
        os.remove(loss_path)
    data = corpus(vocab=cfg.vocab)
    compiled = torch.compile(model, backend=backend)
    writer = None
    if logdir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(logdir, purge_step=step)

    def save() -> None:
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "data_position": position, "rng": _rng_state(), "config": cfg.__dict__}, tmp)
        os.replace(tmp, ckpt_path)  # a crash mid-save never leaves a torn checkpoint

    stack = contextlib.ExitStack()
    # The memory-efficient and flash SDPA backwards are not deterministic on CUDA: use the math one.
    stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
    requested: list[int] = []

    def on_signal(sig: int, _frame) -> None:
        requested.append(sig)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    print(f"training from step {step} to {steps}; SIGUSR1 saves and continues, SIGTERM saves and exits",
          flush=True)
    losses = []
    try:
        while step < steps:
            # Re-arm every step: on the H200 a SIGUSR1 sent after the first steps was swallowed
            # (no handler ran, no exit), as if native code had replaced the C-level handler,
            # which signal.getsignal cannot see; signal.signal installs Python's again.
            for sig in handlers:
                signal.signal(sig, on_signal)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(cfg.accumulation):
                tokens = _batch(data, position, cfg).to(device)
                position += 1
                logits = compiled(tokens[:, :-1])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                (loss / cfg.accumulation).backward()  # averaged over the micro-batches
                total += loss.item() / cfg.accumulation
            optimizer.step()
            step += 1
            losses.append(total)
            with open(loss_path, "a") as f:
                f.write(json.dumps({"step": step, "loss": total}) + "\n")
            if writer:
                writer.add_scalar("tiny_gpt/loss", total, step)
            if requested:
                pending = requested.copy()
                del requested[: len(pending)]  # a signal that lands from here on waits for the next step
                save()
                if signal.SIGTERM in pending:
                    print(f"SIGTERM: checkpoint at step {step} saved to {ckpt_path}; exiting", flush=True)
                    return losses
                print(f"SIGUSR1: checkpoint at step {step} saved; continuing", flush=True)
        save()
    finally:
        stack.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if writer:
            writer.close()
    _plot(loss_path)
    return losses


def _plot(loss_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    with open(loss_path) as f:
        rows = [json.loads(line) for line in f]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("tiny GPT on torch_rmsnorm_op")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.splitext(loss_path)[0] + ".png", dpi=100)
    plt.close(fig)


__all__ = ["GPTConfig", "corpus", "train_integration", "train_tiny_gpt"]
