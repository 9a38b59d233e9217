"""Noise quality (issue 25, item 5): at the same per-token KL to the mean policy, which exploration gives
more useful diversity — temperature, or parameter noise (full, masked, MLP-only, low-rank)? Generation
only, no training.

For each model (the embedded default on its arith task; SmolLM2-135M-Instruct on the word problems,
scored by their last number as `real_model.py` learns them) and each KL level of `--kls`:
- temperature: π_m at T' > T (the sampler's T), T' found by bisection so that KL(π_m^T' ‖ π_m^T) is the level;
- noise arms, θ̂ = m + c · σ ⊙ z with IVON's initial σ (uniform, what a run's first version serves):
  `full` (noise.modules=everything), `masked` (the default mask: decoder-layer weights, no embeddings,
  head, norms or biases), `mlp` (noise.modules=mlp), `lowrank` (the default mask, noise.rank=`--rank`);
  the `--samples` slots chosen by the learner's own noise control (services/learner/noise_control.py:
  c calibrated until the median slot's KL is within 1.25x of the level, a slot over 4x the level
  redrawn), one completion of every prompt each.
KL is measured exactly as the noise control measures it: over the vocabulary at the first 64
predicted tokens of the mean's own completions of the first 16 prompts (the probe).
Per arm and level: pass@k for k = 1, 4, 16, 64 (≤ `--samples`; the unbiased estimator over the
samples of each prompt: slots for noise, draws at T' for temperature), distinct final answers among a
group of 8 (the advantage group of a default run), the malformed rate, and the zero-advantage-group
fraction (groups of 8 whose rewards are all equal). An answer is the last \boxed{} content, else
the last number written (none: no answer, counted as one).

Targets (issue 25): at matched KL, masked noise's malformed rate ≤ temperature's and its pass@16 ≥
temperature's on at least one of the two models. Writes benchmarks/results/noise_quality.{json,md,png};
the rows of a model not measured this time are kept from the JSON file (`--models smollm2` adds the
real model to an earlier run's embedded rows).

    python3 benchmarks/noise_quality.py --quick                # smoke: embedded model, one level
    python3 benchmarks/noise_quality.py                        # both models (~40 min on 2 cores)
"""

from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

import _common

ARMS = {"full": dict(modules="everything"), "masked": dict(modules="all"), "mlp": dict(modules="mlp"),
        "lowrank": dict(modules="all")}  # lowrank: + rank=--rank
GROUP = 8  # rollouts per advantage group (the default run's G)
PROBE_PROMPTS = 16


def parse():
    p = _common.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["embedded", "smollm2"], choices=["embedded", "smollm2"])
    p.add_argument("--kls", nargs="+", type=float, default=[0.003, 0.01, 0.03], help="per-token KL levels (nats)")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts per model (0: 64 embedded, 8 smollm2)")
    p.add_argument("--samples", type=int, default=0, help="samples per prompt (0: 64 embedded, 16 smollm2)")
    p.add_argument("--rank", type=int, default=4, help="rank of the lowrank arm's noise per matrix")
    return p.parse_args()


def model_setup(name: str, args) -> dict:
    """The model's checkpoint, run config (task, verifier, prompt, sampler) and generation settings."""
    if name == "embedded":
        cfg = _common.config(_common.model_path(args), ["sampler.threads=2"])
        return dict(cfg=cfg, prompts=args.prompts or 64, samples=args.samples or 64, tokens=cfg.sampler.max_new_tokens,
                    temperature=cfg.sampler.temperature)
    import real_model

    class Sizes:
        problems, tokens = 400, 96
    model, data = real_model.model_and_data(Sizes)
    cfg = _common.config(model, [f"data.path={data}", "data.format=gsm8k", *real_model.LAST_NUMBER,
                                 "sampler.dtype=bfloat16", "sampler.threads=2", "sampler.batch_size=64"])
    return dict(cfg=cfg, prompts=args.prompts or 8, samples=args.samples or 16, tokens=96, temperature=0.7)


class Bench:
    """One model: its engine, items, verifier, posterior and the probe on which KL is measured."""

    def __init__(self, setup: dict, args) -> None:
        import torch

        from threepo.algorithms.weight_checks import weights_checksum
        from threepo.services.model.modeling import load_model, trainable_named_parameters
        from threepo.services.sampling.engines.hf import HFEngine
        from threepo.services.tasks.datasets import eval_items
        from threepo.services.tasks.prompting import PromptEncoder
        from threepo.services.verifiers.pool import VerifierPool

        torch.set_num_threads(2)
        cfg = self.cfg = setup["cfg"]
        self.samples, self.tokens, self.temperature = setup["samples"], setup["tokens"], setup["temperature"]
        self.items = eval_items(cfg.data, cfg.task, cfg.eval)[:setup["prompts"]]
        self.encoder = PromptEncoder.from_path(cfg.model.path, cfg.prompt)
        self.pool = VerifierPool(cfg.verifier, sandbox=cfg.sandbox, token=cfg.sandbox.token())
        self.engine = HFEngine(cfg.model.path, cfg.sampler, dtype=cfg.model.dtype)
        self.model = load_model(cfg.model.path).eval()  # fp32: where KL is measured, as the learner does
        self.named = trainable_named_parameters(self.model)
        self.mean, self.sigma = _common.posterior_arrays(cfg.model.path, cfg)
        self.checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in self.mean.items())
        self.version = 0
        self.probe = self._probe()

    def _probe(self) -> SimpleNamespace:
        """The mean's completions of the first prompts as the KL probe reads a batch (input_ids, attn, mask)."""
        import torch

        from threepo.services.sampling.engines.base import EngineRequest
        from threepo.services.wire.messages import NoiseSpec

        self._load(0)
        self.engine.serve(NoiseSpec(self.version, None))
        prompts = [self.encoder.encode(it.prompt, it.verifier) for it in self.items[:PROBE_PROMPTS]]
        out = self.engine.generate([EngineRequest(p, 1, i) for i, p in enumerate(prompts)], self._params(self.temperature, 1))
        rows = [list(p) + list(g[0].token_ids) for p, g in zip(prompts, out)]
        width = max(len(r) for r in rows)
        ids, attn, mask = (torch.zeros(len(rows), w, dtype=torch.long) for w in (width, width, width - 1))
        for r, (p, row) in enumerate(zip(prompts, rows)):
            ids[r, :len(row)], attn[r, :len(row)] = torch.tensor(row), 1
            mask[r, len(p) - 1:len(row) - 1] = 1
        return SimpleNamespace(input_ids=ids, attn=attn, mask=mask)  # the fields of a TrainBatch the probe reads

    def _params(self, temperature: float, n: int):
        from threepo.services.wire.messages import SamplingParams

        return SamplingParams(temperature=temperature, max_new_tokens=self.tokens, n=n, stop_token_ids=self.encoder.stop_ids)

    def _load(self, rank: int, noised=None) -> None:
        """The engine at a new version: m, σ zero outside `noised` (None: σ everywhere), noise of `rank`."""
        import numpy as np

        self.version += 1
        sigma = {n: s if noised is None or n in noised else np.zeros_like(s) for n, s in self.sigma.items()}
        self.engine.load_version(self.version, self.mean, sigma, self.checksum, rank)

    # --- matching the KL ---------------------------------------------------------------------------
    def noise_slots(self, arm: dict, level: float, start: float, level_index: int) -> tuple[list, dict, set]:
        """The `samples` slots of the arm at `level` as the learner's noise control chooses them (the
        scale calibrated from `start`, slots over its gate redrawn), its metrics, and the noised names."""
        from threepo.algorithms.noise_mask import NoiseConfig
        from threepo.services.learner.noise_control import NoiseControl
        from threepo.services.learner.optimizers import IVONPosterior
        from threepo.services.learner.ranks import SingleRank

        noise = NoiseConfig(**arm, target_kl=level)
        optimizer = IVONPosterior(self.named, self.cfg.optim, SingleRank(), noise)
        control = NoiseControl(noise, n_slots=self.samples, base_seed=7, temperature=self.temperature)
        control.scale = start
        control.observe(self.probe)
        slots = control.plan(self.model, optimizer, step=level_index)
        return slots, control.latest, optimizer.noised

    def temperature_for(self, level: float) -> tuple[float, float]:
        """(T', KL(π_m^T' ‖ π_m^T)) with T' ≥ T solving for `level` by bisection on the probe's logits."""
        import torch

        from threepo.algorithms.noise_mask import NoiseConfig
        from threepo.services.learner.noise_control import NoiseControl

        control = NoiseControl(NoiseConfig(target_kl=level), n_slots=1, base_seed=1, temperature=self.temperature)
        control.observe(self.probe)
        with torch.no_grad():
            logits = torch.cat(control.logits(self.model))
        base = torch.log_softmax(logits / self.temperature, -1)

        def kl(t: float) -> float:
            hot = torch.log_softmax(logits / t, -1)
            return float((hot.exp() * (hot - base)).sum(-1).mean())
        lo, hi = self.temperature, self.temperature * 8
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if kl(mid) < level else (lo, mid)
        return hi, kl(hi)

    # --- sampling and scoring ----------------------------------------------------------------------
    def sample_noise(self, slots: list, noised: set, rank: int) -> list[list]:
        """Each (seed, scale) slot's completion of every prompt: [prompt][slot] samples."""
        from threepo.services.sampling.engines.base import EngineRequest
        from threepo.services.wire.messages import NoiseSpec

        self._load(rank, noised)
        prompts = [self.encoder.encode(it.prompt, it.verifier) for it in self.items]
        groups = [(NoiseSpec(self.version, seed, scale), [EngineRequest(p, 1, 1000 * s + i) for i, p in enumerate(prompts)])
                  for s, (seed, scale) in enumerate(slots)]
        out = self.engine.generate_slots(groups, self._params(self.temperature, 1))
        return [[out[s][2][i][0] for s in range(self.samples)] for i in range(len(prompts))]

    def sample_temperature(self, temperature: float) -> list[list]:
        from threepo.services.sampling.engines.base import EngineRequest
        from threepo.services.wire.messages import NoiseSpec

        self._load(0)
        self.engine.serve(NoiseSpec(self.version, None))
        prompts = [self.encoder.encode(it.prompt, it.verifier) for it in self.items]
        out = self.engine.generate([EngineRequest(p, self.samples, i) for i, p in enumerate(prompts)],
                                   self._params(temperature, self.samples))
        return [list(g) for g in out]

    def score(self, samples: list[list]) -> dict:
        """pass@k, distinct answers per group, malformed rate, zero-advantage-group fraction."""
        from threepo.algorithms.pass_at_k import pass_at_k
        from threepo.services.verifiers.math_answers import final_boxed, last_number
        from threepo.services.wire.messages import VerifyRequest, VerifyStatus

        n = len(samples[0])
        results = self.pool.verify_batch([VerifyRequest(item=it, completion=s.text, finish_reason=s.finish_reason)
                                          for it, group in zip(self.items, samples) for s in group])
        if any(r.status is VerifyStatus.INFRA_ERROR for r in results):
            raise RuntimeError("a verification failed with infra_error: the figures would be biased")
        ok = [[r.status is VerifyStatus.OK for r in results[i * n:(i + 1) * n]] for i in range(len(samples))]
        out = {f"pass@{k}": float(pass_at_k([n] * len(ok), [sum(o) for o in ok], k).mean())
               for k in (1, 4, 16, 64) if k <= n}
        groups = [(i, g) for i in range(len(samples)) for g in range(0, n - GROUP + 1, GROUP)]
        answer = lambda text: final_boxed(text)[0] or last_number(text)  # noqa: E731  boxed, else the last number
        out["distinct_answers"] = sum(len({answer(s.text) for s in samples[i][g:g + GROUP]}) for i, g in groups) / len(groups)
        out["malformed"] = sum(r.status is VerifyStatus.MALFORMED for r in results) / len(results)
        out["zero_adv_groups"] = sum(len(set(ok[i][g:g + GROUP])) == 1 for i, g in groups) / len(groups)
        return out

    def close(self) -> None:
        self.pool.close()
        self.engine.close()


def run_model(name: str, args) -> list[dict]:
    from threepo.algorithms.noise_mask import NoiseConfig

    setup = model_setup(name, args)
    bench, rows = Bench(setup, args), []
    print(f"{name}: {len(bench.items)} prompts x {bench.samples} samples, {bench.tokens} tokens, T {bench.temperature}")
    base = {"model": name, "arm": "mean", "level": 0.0, "kl": 0.0, "knob": bench.temperature}
    rows.append({**base, **bench.score(bench.sample_temperature(bench.temperature))})
    print(rows[-1])
    scales = {arm: 1.0 for arm in ARMS}
    for li, level in enumerate(args.kls):
        started = time.perf_counter()
        t, kl = bench.temperature_for(level)
        rows.append({"model": name, "arm": "temperature", "level": level, "kl": kl, "knob": t,
                     **bench.score(bench.sample_temperature(t))})
        print(rows[-1])
        for arm, spec in ARMS.items():
            rank = args.rank if arm == "lowrank" else "full"
            slots, latest, noised = bench.noise_slots({**spec, "rank": rank}, level, scales[arm], li)
            scales[arm] = latest["noise_scale"]
            rows.append({"model": name, "arm": arm, "level": level, "kl": latest["noise_kl"], "knob": scales[arm],
                         "kl_served_max": latest["noise_kl_served_max"], "redraws": latest["noise_redraws"],
                         **bench.score(bench.sample_noise(slots, noised, NoiseConfig(rank=rank).slot_rank))})
            print(rows[-1])
        print(f"{name}: level {level} in {time.perf_counter() - started:.0f} s")
    bench.close()
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets per model and level: masked vs temperature."""
    lines = []
    for model in sorted({r["model"] for r in rows}):
        for level in sorted({r["level"] for r in rows if r["level"]}):
            at = {r["arm"]: r for r in rows if r["model"] == model and r["level"] == level}
            if "masked" not in at or "temperature" not in at:
                continue
            m, t = at["masked"], at["temperature"]
            k = "pass@16" if "pass@16" in m else max((key for key in m if key.startswith("pass@")), key=lambda s: int(s[5:]))
            lines.append(f"{model} KL {level:g}: malformed masked {m['malformed']:.3f} vs temperature {t['malformed']:.3f} "
                         f"({'met' if m['malformed'] <= t['malformed'] else 'missed by %.3f' % (m['malformed'] - t['malformed'])}); "
                         f"{k} masked {m[k]:.3f} vs temperature {t[k]:.3f} "
                         f"({'met' if m[k] >= t[k] else 'missed by %.3f' % (t[k] - m[k])})")
    return lines


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    metrics = ["pass@1", "pass@16", "distinct_answers", "malformed", "zero_adv_groups"]
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(4 * len(metrics), 3.2 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        mean = next(r for r in mine if r["arm"] == "mean")
        for j, metric in enumerate(metrics):
            ax = axes[i][j]
            for arm in ["temperature", *ARMS]:
                pts = sorted((r["kl"], r[metric]) for r in mine if r["arm"] == arm and metric in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
            if metric in mean:
                ax.axhline(mean[metric], color="grey", linestyle=":", label="mean policy")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no overlapping labels
            ax.set_xlabel("per-token KL to the mean (nats)")
            ax.set_title(f"{model}: {metric}")
        axes[i][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> None:
    args = parse()
    if args.quick:
        args.models, args.kls = ["embedded"], args.kls[1:2]
        args.prompts, args.samples = args.prompts or 16, args.samples or 16
    path, rows = _common.results_path("noise_quality", args.quick), []
    if os.path.exists(path):  # the other models' rows stay: a model can be (re)measured on its own
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r["model"] not in args.models]
    for name in args.models:
        rows += run_model(name, args)
        _common.write_results("noise_quality", {"args": vars(args), "rows": rows})
    headers = ["model", "arm", "level", "kl", "knob", "pass@1", "pass@4", "pass@16", "pass@64", "distinct",
               "malformed", "zero-adv"]
    table = _common.table("noise quality (knob: T' for temperature, σ scale c for noise)", headers,
                          [[r["model"], r["arm"], r["level"], r["kl"], r["knob"], *(r.get(f"pass@{k}", "") for k in (1, 4, 16, 64)),
                            r["distinct_answers"], r["malformed"], r["zero_adv_groups"]] for r in rows])
    lines = targets(rows)
    print("\n".join(lines))
    _common.write_results("noise_quality", {"args": vars(args), "rows": rows, "targets": lines})
    with open(_common.results_path("noise_quality", args.quick, "md"), "w") as f:
        f.write(table + "\n\n" + "\n".join(lines) + "\n")
    figure(rows, _common.results_path("noise_quality", args.quick, "png"))


if __name__ == "__main__":
    main()
