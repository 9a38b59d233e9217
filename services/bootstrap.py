"""`threepo bootstrap`: make the embedded default policy — a tiny model warm-started by SFT on a task.

A fresh Qwen2-family model (services/modeling.py) with the char-level tokenizer is trained on
fresh train-split problems (loss on the completion `\\boxed{answer}<eos>` only) until its held-out
pass@1 when sampling at temperature 1 reaches `target_pass1`: a policy RL can still improve, which
produces mixed groups. The result is an HF checkpoint (safetensors + tokenizer + `bootstrap.json`)
in a cache directory keyed by every setting that changes it, so later runs reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from threepo.services.modeling import ModelConfig
from threepo.services.tasks import TaskConfig

FORMAT = 1  # bump when the bootstrap recipe changes in a way the cache key cannot see


@dataclass(frozen=True)
class BootstrapConfig:
    """Supervised warm start of the embedded default model."""

    target_pass1: float = 0.4
    """Stop once held-out pass@1 (T=1) reaches this; must lie in (0.2, 0.8) to leave RL room."""
    max_seconds: float = 280.0
    """Give up (and do not cache) if the target is not reached by then."""
    lr: float = 3e-3
    """AdamW peak learning rate (constant after warm-up)."""
    warmup_steps: int = 100
    """Linear learning-rate warm-up."""
    batch_size: int = 128
    """Fresh train problems per step."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    eval_every: int = 150
    """Steps between held-out evaluations."""
    eval_items: int = 256
    """Held-out items per evaluation (one sample each)."""
    threads: int = 2
    """Torch threads for training."""
    seed: int = 0
    """Seed of initialisation and of the training problem stream."""
    cache_dir: str = ""
    """Where bootstrapped checkpoints are cached ('' = $THREEPO_CACHE or ~/.cache/threepo)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target_pass1 < 1.0:
            raise ValueError(f"bootstrap.target_pass1: expected in (0, 1), got {self.target_pass1}")
        if self.max_seconds <= 0 or self.batch_size < 1 or self.eval_every < 1:
            raise ValueError("bootstrap.max_seconds, batch_size and eval_every: expected positive values")


@dataclass(frozen=True)
class BootstrapResult:
    path: str
    heldout_pass1: float
    seconds: float
    steps: int
    reached_target: bool
    cached: bool


def cache_root(cfg: BootstrapConfig) -> str:
    return cfg.cache_dir or os.environ.get("THREEPO_CACHE") or os.path.expanduser("~/.cache/threepo")


def checkpoint_dir(model_cfg: ModelConfig, task_cfg: TaskConfig, cfg: BootstrapConfig) -> str:
    """Cache path keyed by everything that changes the checkpoint — not threads, cache_dir or the time
    limit (only a run that reached the target is cached, and the limit does not change where it stops)."""
    recipe = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("threads", "cache_dir", "max_seconds")}
    key = json.dumps([FORMAT, dataclasses.asdict(model_cfg), dataclasses.asdict(task_cfg), recipe], sort_keys=True)
    digest = hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
    return os.path.join(cache_root(cfg), "models", f"{model_cfg.kind}-{task_cfg.family}-{digest}")


def ensure_bootstrapped(model_cfg: ModelConfig, task_cfg: TaskConfig, cfg: BootstrapConfig, *,
                        progress: bool = True) -> BootstrapResult:
    """The cached checkpoint for these settings, training it first if there is none."""
    path = checkpoint_dir(model_cfg, task_cfg, cfg)
    if os.path.isfile(os.path.join(path, "bootstrap.json")):
        with open(os.path.join(path, "bootstrap.json")) as f:
            report = json.load(f)
        return BootstrapResult(path=path, heldout_pass1=report["heldout_pass1"], seconds=report["seconds"],
                               steps=report["steps"], reached_target=True, cached=True)
    return bootstrap(model_cfg, task_cfg, cfg, out_dir=path, progress=progress)


def bootstrap(model_cfg: ModelConfig, task_cfg: TaskConfig, cfg: BootstrapConfig, *, out_dir: str,
              progress: bool = True) -> BootstrapResult:
    """Train until held-out pass@1 ≥ target (or max_seconds); save atomically to `out_dir` only if
    the target was reached (a failed warm start must not be cached and silently reused)."""
    import torch

    from threepo.services.tokenizer import build_tokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 8) * 8
    from threepo.services.modeling import build_model
    model = build_model(model_cfg, vocab_size=vocab_size, pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, seed=cfg.seed)
    started = time.monotonic()
    steps, pass1 = _train(model, tokenizer, task_cfg, cfg, progress=progress)
    seconds = time.monotonic() - started
    reached = pass1 >= cfg.target_pass1
    report = {"heldout_pass1": pass1, "seconds": round(seconds, 1), "steps": steps,
              "target_pass1": cfg.target_pass1, "task": dataclasses.asdict(task_cfg),
              "model": dataclasses.asdict(model_cfg)}
    if not reached:
        out_dir = tempfile.mkdtemp(prefix="threepo-bootstrap-failed-")
    _save_atomically(model, tokenizer, report, out_dir)
    return BootstrapResult(path=out_dir, heldout_pass1=pass1, seconds=seconds, steps=steps,
                           reached_target=reached, cached=False)


def _save_atomically(model, tokenizer, report: dict, out_dir: str) -> None:
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "bootstrap.json"), "w") as f:
        json.dump(report, f, indent=2)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _train(model, tokenizer, task_cfg: TaskConfig, cfg: BootstrapConfig, *, progress: bool) -> tuple[int, float]:
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    started, step, pass1 = time.monotonic(), 0, 0.0
    bar = tqdm(total=int(cfg.max_seconds), unit="s", desc="bootstrap", disable=not progress,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total}s [{postfix}]")
    model.train()
    while time.monotonic() - started < cfg.max_seconds:
        input_ids, attn, labels = _sft_batch(tokenizer, task_cfg, cfg.seed * 1_000_003 + step, cfg.batch_size)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        if step % cfg.eval_every == 0:
            pass1 = heldout_pass1(model, tokenizer, task_cfg, cfg.eval_items)
        bar.set_postfix_str(f"step {step} loss {loss.item():.3f} heldout pass@1 {pass1:.2f}", refresh=False)
        bar.update(int(time.monotonic() - started) - bar.n)
        if pass1 >= cfg.target_pass1:
            break
    bar.close()
    model.eval()
    return step, pass1


def _sft_batch(tokenizer, task_cfg: TaskConfig, seed: int, batch_size: int):
    """Right-padded prompt+completion+eos sequences; labels only on completion and eos."""
    import torch

    from threepo.services.tasks import expected_completion, generate_items

    items = generate_items(task_cfg.family, "train", batch_size, seed=seed, difficulty=task_cfg.difficulty)
    rows = []
    for item in items:
        prompt = tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
        target = tokenizer(expected_completion(item), add_special_tokens=False)["input_ids"]
        rows.append((prompt, target + [tokenizer.eos_token_id]))
    width = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    attn = torch.zeros_like(input_ids)
    for r, (prompt, target) in enumerate(rows):
        seq = prompt + target
        input_ids[r, :len(seq)] = torch.tensor(seq)
        labels[r, len(prompt):len(seq)] = torch.tensor(target)
        attn[r, :len(seq)] = 1
    return input_ids, attn, labels


def heldout_pass1(model, tokenizer, task_cfg: TaskConfig, num_items: int) -> float:
    """One T=1 sample per held-out item, scored by the task's verifier."""
    from threepo.services.evaluation import model_pass_at_1
    from threepo.services.tasks import generate_items

    items = generate_items(task_cfg.family, "heldout", num_items, seed=task_cfg.seed,
                           difficulty=task_cfg.difficulty)
    return model_pass_at_1(model, tokenizer, items, temperature=1.0, max_new_tokens=24)
