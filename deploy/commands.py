"""What each `threepo` subcommand does once its arguments are parsed (deploy/cli.py parses them and
is imported by nothing): check the inputs a config names, make the run directory, find the policy,
and run `bootstrap`, `eval` or `train` (the driver loop itself: deploy/run.py). Benchmarks and tests
call these functions as the CLI does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time


def check_inputs(cfg) -> None:
    """Check every path the config names (model, datasets), that its prompts can be built, and the
    verifier settings that depend on this machine before anything starts; raises `UserInputError`
    naming the key, file and line."""
    from threepo.services.errors import UserInputError
    from threepo.services.model.modeling import resolve_model
    from threepo.services.tasks.datasets import run_items
    from threepo.services.tasks.prompting import PromptEncoder
    from threepo.services.verifiers.base import available_verifiers

    cfg.sandbox.token()  # a token variable that is not set fails here, before anything starts
    unknown = sorted({target for _, target in cfg.verifier.route} - set(available_verifiers()))
    if unknown:
        raise UserInputError(f"verifier.route: unknown verifier {unknown[0]!r}; expected one of {available_verifiers()}")
    if cfg.model.path:
        PromptEncoder.from_path(resolve_model(cfg.model.path), cfg.prompt).check()
    rows = run_items(cfg.data, cfg.task, "train", 1 if not cfg.data.path else 10 ** 9)
    if cfg.data.path:
        rows += run_items(cfg.data, cfg.task, "heldout", 10 ** 9)
    local = {dict(cfg.verifier.route).get(r.verifier, r.verifier) for r in rows} & {"code_output", "code_tests"}
    if local and shutil.which("bwrap") is None:
        raise UserInputError(f"rows verified by {sorted(local)} run programs in the local sandbox, which needs "
                             "bubblewrap: apt-get install -y bubblewrap, or score them remotely with "
                             "verifier.route=[[\"code_output\", \"remote_sandbox\"]] and sandbox.endpoints")


@contextlib.contextmanager
def run_directory(cfg, command: str):
    """`make_run_dir`, removed again if the command fails before writing anything but its config."""
    run_dir = make_run_dir(cfg, command)
    try:
        yield run_dir
    except BaseException:
        written = [os.path.join(root, f) for root, _, files in os.walk(run_dir) for f in files]
        if all(os.path.basename(f) == "config.toml" or os.path.getsize(f) == 0 for f in written):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def make_run_dir(cfg, command: str) -> str:
    """A fresh run directory holding the resolved config."""
    from threepo.deploy.config import to_toml
    from threepo.services.errors import UserInputError

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = os.path.join(cfg.runs_dir, f"{cfg.name}-{command}-{stamp}")
    suffix = 0
    while os.path.exists(run_dir + (f"-{suffix}" if suffix else "")):
        suffix += 1
    run_dir += f"-{suffix}" if suffix else ""
    try:
        os.makedirs(run_dir)
    except OSError as err:
        raise UserInputError(f"runs_dir={cfg.runs_dir!r}: cannot make the run directory {run_dir} "
                             f"({err.strerror}); expected a writable directory") from None
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    return run_dir


def policy_path(cfg) -> str:
    """The checkpoint to serve: `model.path` (a hub id resolved to its local snapshot), or the
    (cached) bootstrapped embedded default."""
    if cfg.model.path:
        from threepo.services.model.modeling import resolve_model

        return resolve_model(cfg.model.path)
    from threepo.services.bootstrap import BootstrapFailed, ensure_bootstrapped

    result = ensure_bootstrapped(cfg.model, cfg.task, cfg.bootstrap)
    if not result.reached_target:
        raise BootstrapFailed(result.failure(cfg.bootstrap))
    return result.path


def cmd_bootstrap(cfg, run_dir: str) -> int:
    from threepo.services.bootstrap import ensure_bootstrapped

    result = ensure_bootstrapped(cfg.model, cfg.task, cfg.bootstrap)
    with open(os.path.join(run_dir, "bootstrap.json"), "w") as f:
        json.dump(result.__dict__, f, indent=2)
    state = "reused cached" if result.cached else f"trained {result.steps} steps in {result.seconds:.0f}s,"
    print(f"bootstrap: {state} checkpoint {result.path}")
    print(f"bootstrap: held-out pass@1 at T=1 during warm start: {result.heldout_pass1:.3f}")
    if not result.reached_target:
        print(f"threepo bootstrap: {result.failure(cfg.bootstrap)} (checkpoint not cached)", file=sys.stderr)
        return 1
    return 0


def cmd_eval(cfg, run_dir: str, path: str) -> int:
    from threepo.services.tasks.datasets import split_note

    if cfg.data.path:
        print(f"eval: {split_note(cfg.data)}")
    report = evaluate_policy(cfg, path, label="eval")
    print(f"eval: {report.summary()}")
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump(report.__dict__, f, indent=2)
    return 0


def evaluate_policy(cfg, path: str, *, label: str):
    """Evaluate the checkpoint at `path` on the configured items, with a progress bar."""
    from tqdm import tqdm

    from threepo.services.evaluation import Evaluator
    from threepo.services.sampling.engines.base import SamplerConfig
    from threepo.services.tasks.datasets import eval_items

    items = eval_items(cfg.data, cfg.task, cfg.eval)
    evaluator = Evaluator.serving(path, items, cfg.verifier, cfg.prompt,
                                  SamplerConfig(threads=cfg.bootstrap.threads, batch_size=cfg.eval.batch_size,
                                                seed=cfg.seed, device=cfg.eval.device),
                                  sandbox=cfg.sandbox, dtype=cfg.model.dtype, seed=cfg.seed)  # token: read here
    try:
        with tqdm(total=len(items), desc=label, unit="item") as bar:
            return evaluator.evaluate(samples_per_item=cfg.eval.samples_per_item, k=cfg.eval.k,
                                      temperature=cfg.eval.temperature, max_new_tokens=cfg.sampler.max_new_tokens,
                                      progress=bar.update)
    finally:
        evaluator.close()


def cmd_train(cfg, resume_dir: str | None) -> int:
    """`threepo train` on a checked config: evaluate, run (deploy/run.py), evaluate again, report.
    A fresh run directory is made only once the policy exists, and removed if the run fails before
    writing anything; a resumed run keeps its own."""
    from threepo.deploy import checkpoints
    from threepo.deploy.run import RunStopped  # Ray and the roles: only once the input is known good

    path = policy_path(cfg)
    resume_from = checkpoints.latest(resume_dir) if resume_dir else None
    with contextlib.nullcontext(resume_dir) if resume_dir else run_directory(cfg, "train") as run_dir:
        try:
            return _train_and_report(cfg, run_dir, path, resume_from)
        except RunStopped as stopped:
            print(f"threepo train: {stopped}", file=sys.stderr)
            return 1


def _train_and_report(cfg, run_dir: str, path: str, resume_from: str | None) -> int:
    from threepo.deploy.run import RunStopped, train
    from threepo.services.tasks.datasets import split_note
    from threepo.services.verifiers.base import VerifierOutage

    print(f"train: run directory {run_dir}")
    if cfg.data.path:
        print(f"train: {split_note(cfg.data)}")
    around = cfg.eval.around_training
    try:
        before = evaluate_policy(cfg, path, label="held-out before") if around else None
    except VerifierOutage as err:
        raise RunStopped(f"held-out evaluation before training: {err}") from None
    summary = train(cfg, run_dir, path, resume_from=resume_from)
    after = evaluate_policy(cfg, summary["final_checkpoint"], label="held-out after") if around else None
    if around:
        print(f"train: held-out before: {before.summary()}")
        print(f"train: held-out after:  {after.summary()}")
        with open(os.path.join(run_dir, "eval.json"), "w") as f:
            json.dump({"before": before.__dict__, "after": after.__dict__}, f, indent=2)
    print(f"train: rollouts admitted {summary['admitted_rollouts']}, consumed {summary['consumed_rollouts']} "
          f"(re-issued requests {summary['reissued_requests']}); report: {', '.join(summary['report'])}")
    print("train: peak memory (MiB) " + ", ".join(f"{role} {mb:,.0f}" for role, mb in summary["peak_memory_mb"].items())
          + f"; {summary['peak_memory_total_mb']:,.0f} in all (shared pages counted in each process that read them)")
    return 0
