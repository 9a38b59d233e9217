"""`threepo bootstrap`: make the embedded default policy — a tiny model warm-started by SFT on a task.

A fresh Qwen2-family model (services/model/modeling.py) with the char-level tokenizer is trained on
fresh train-split problems (loss on the completion `\\boxed{answer}<eos>` only) until its held-out
pass@1 when sampling at temperature 1 reaches `target_pass1`: a policy RL can still improve, which
produces mixed groups. The result is an HF checkpoint (safetensors + tokenizer + `bootstrap.json`)
in a cache directory keyed by every setting that changes it, so later runs reuse it.

Bounded by steps, not time: the held-out check runs every `eval_every` steps and training stops at
the first check that reaches the target, or after `max_steps`. Batches, initialisation and the
held-out samples are all seeded, so a recipe gives the same checkpoint on a busy machine as on a
quiet one (same torch build and `threads`; a different CPU instruction set may round differently).
A recipe that misses its target within `max_steps` misses it everywhere: the result says so and is
not cached. `max_seconds` is only a safety net against a machine far slower than any expected; when
it fires the result says that, too.
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

from threepo.services.model.modeling import ModelConfig
from threepo.services.tasks.synthetic import TaskConfig

FORMAT = 1  # bump when the bootstrap recipe changes in a way the cache key cannot see


@dataclass(frozen=True)
class BootstrapConfig:
    """Supervised warm start of the embedded default model."""

    target_pass1: float = 0.4
    """Stop once held-out pass@1 (T=1) reaches this: 0.2-0.8 gives mixed groups; a low target makes
    a hard starting point (recipe countdown_hard: 0.05, most groups of 16 all-fail)."""
    max_steps: int = 3000
    """Step budget: give up (and do not cache) if the target is not reached after this many steps."""
    max_seconds: float = 14400.0
    """Wall-clock safety net only (the step budget decides): stop, uncached, after this long."""
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
    """Seed of initialisation and of the training problem stream (not the run's `seed`: one warm
    start serves every run seed)."""
    cache_dir: str = ""
    """Where bootstrapped checkpoints are cached ('' = $THREEPO_CACHE or ~/.cache/threepo)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.target_pass1 < 1.0:
            raise ValueError(f"bootstrap.target_pass1: expected in (0, 1), got {self.target_pass1}")
        for name in ("max_steps", "max_seconds", "batch_size", "eval_every", "eval_items", "threads"):
            if not getattr(self, name) > 0:
                raise ValueError(f"bootstrap.{name}: expected > 0, got {getattr(self, name)}")


class BootstrapFailed(RuntimeError):
    """The embedded default could not be bootstrapped; the message (`BootstrapResult.failure`)
    says why and what to change. `threepo` prints it as one line and exits 1."""


@dataclass(frozen=True)
class BootstrapResult:
    path: str
    heldout_pass1: float
    seconds: float
    steps: int
    reached_target: bool
    cached: bool
    stopped_by: str = "target"
    """What ended training: "target", "max_steps" (the recipe misses its target) or "max_seconds"."""

    def failure(self, cfg: BootstrapConfig) -> str:
        """One line on why the target was missed and what to change ("" when it was reached)."""
        if self.reached_target:
            return ""
        got = f"held-out pass@1 {self.heldout_pass1:.3f} < bootstrap.target_pass1 {cfg.target_pass1}"
        if self.stopped_by == "max_seconds":
            return (f"bootstrap stopped by its wall-clock safety net (bootstrap.max_seconds="
                    f"{cfg.max_seconds:g}) at step {self.steps} of {cfg.max_steps} with {got}: this "
                    "machine is far slower than expected; raise bootstrap.max_seconds")
        return (f"bootstrap used its whole step budget (bootstrap.max_steps={cfg.max_steps}) with {got}; "
                "this recipe misses its target on every machine: raise bootstrap.max_steps or lower "
                "bootstrap.target_pass1")


def cache_root(cfg: BootstrapConfig) -> str:
    return cfg.cache_dir or os.environ.get("THREEPO_CACHE") or os.path.expanduser("~/.cache/threepo")


def warm_start_task(task_cfg: TaskConfig, cfg: BootstrapConfig) -> TaskConfig:
    """The task a warm start trains and checks on: the run's family and difficulty, drawn with
    `bootstrap.seed` (not the run's `task.seed`, which follows the run's seed: one warm start serves
    every run seed)."""
    return dataclasses.replace(task_cfg, seed=cfg.seed)


def checkpoint_dir(model_cfg: ModelConfig, task_cfg: TaskConfig, cfg: BootstrapConfig) -> str:
    """Cache path keyed by the recipe: everything that changes the checkpoint, never the machine. Not
    threads or cache_dir, and not the budgets: only a run that reached the target is cached, and it
    stops at the first held-out check that reaches it whatever max_steps or max_seconds allowed."""
    task_cfg = warm_start_task(task_cfg, cfg)
    recipe = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("threads", "cache_dir", "max_seconds", "max_steps")}
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
    """Train until held-out pass@1 ≥ target (or the step budget, or the safety net); save atomically
    to `out_dir` only if the target was reached (a failed warm start must not be cached and reused)."""
    import torch

    from threepo.services.model.tokenizer import build_tokenizer

    task_cfg = warm_start_task(task_cfg, cfg)
    torch.set_num_threads(cfg.threads)
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 8) * 8
    from threepo.services.model.modeling import build_model
    model = build_model(model_cfg, vocab_size=vocab_size, pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, seed=cfg.seed)
    started = time.monotonic()
    steps, pass1, stopped_by = _train(model, tokenizer, task_cfg, cfg, progress=progress)
    seconds = time.monotonic() - started
    reached = pass1 >= cfg.target_pass1
    report = {"heldout_pass1": pass1, "seconds": round(seconds, 1), "steps": steps,
              "target_pass1": cfg.target_pass1, "stopped_by": stopped_by, "task": dataclasses.asdict(task_cfg),
              "model": dataclasses.asdict(model_cfg)}
    if not reached:
        out_dir = tempfile.mkdtemp(prefix="threepo-bootstrap-failed-")
    _save_atomically(model, tokenizer, report, out_dir)
    return BootstrapResult(path=out_dir, heldout_pass1=pass1, seconds=seconds, steps=steps,
                           reached_target=reached, cached=False, stopped_by=stopped_by)


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


def _train(model, tokenizer, task_cfg: TaskConfig, cfg: BootstrapConfig, *,
           progress: bool) -> tuple[int, float, str]:
    """Steps taken, the last held-out pass@1, and what stopped training (see BootstrapResult)."""
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    started, step, pass1, stopped_by = time.monotonic(), 0, 0.0, "max_steps"
    bar = tqdm(total=cfg.max_steps, unit="step", desc="bootstrap (stops at the target)", disable=not progress)
    model.train()
    while step < cfg.max_steps:
        input_ids, attn, labels = _sft_batch(tokenizer, task_cfg, cfg.seed * 1_000_003 + step, cfg.batch_size)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            pass1 = heldout_pass1(model, tokenizer, task_cfg, cfg.eval_items)
        bar.set_postfix_str(f"loss {loss.item():.3f} heldout pass@1 {pass1:.2f}", refresh=False)
        bar.update(1)
        if pass1 >= cfg.target_pass1:
            stopped_by = "target"
            break
        if time.monotonic() - started > cfg.max_seconds:
            stopped_by = "max_seconds"
            break
    bar.close()
    model.eval()
    return step, pass1, stopped_by


def _sft_batch(tokenizer, task_cfg: TaskConfig, seed: int, batch_size: int):
    """Right-padded prompt+completion+eos sequences; labels only on completion and eos."""
    import torch

    from threepo.services.tasks.synthetic import expected_completion, generate_items

    items = generate_items(task_cfg.family, "train", batch_size, seed=seed, difficulty=task_cfg.difficulty)
    prompts, rows = _prompts(tokenizer), []
    for item in items:
        prompt = list(prompts.encode(item.prompt, item.verifier))
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
    from threepo.services.evaluation import Evaluator
    from threepo.services.tasks.synthetic import generate_items, max_new_tokens_for

    items = generate_items(task_cfg.family, "heldout", num_items, seed=task_cfg.seed,
                           difficulty=task_cfg.difficulty)
    limit = max_new_tokens_for(task_cfg.family, task_cfg.difficulty)  # the limit training samples with
    evaluator = Evaluator.of_model(model, _prompts(tokenizer), items)
    try:
        return evaluator.evaluate(samples_per_item=1, k=1, temperature=1.0, max_new_tokens=limit).pass_at_1
    finally:
        evaluator.close()


def _prompts(tokenizer):
    """The embedded model reads raw text (its character tokenizer has no chat template)."""
    from threepo.services.tasks.prompting import PromptConfig, PromptEncoder

    return PromptEncoder(tokenizer, PromptConfig(template="none"))
