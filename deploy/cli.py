"""The `threepo` command line: `bootstrap`, `eval`, `train`.

Every subcommand takes `--config RECIPE` (a TOML file or a shipped recipe name) and overrides
`section.field=value`; `threepo <cmd> --show-config` prints the resolved config and exits. Heavy
imports happen inside the subcommands so that `threepo --help` stays instant.

Errors: a user mistake (`UserInputError`: a config key, a path, a dataset line) is one line naming
it and what was expected, exit 2, checked before anything heavy is imported or any run directory is
made; a bootstrap that misses its target is one line, exit 1. `--debug` shows the traceback
instead. A command that fails leaves no run directory holding nothing but its config.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="threepo",
        description="Asynchronous RL with verifiable rewards, exploring in parameter space.",
        epilog="Overrides look like sampler.temperature=0.7 or algo.exploration=grpo; "
               "see README.md (Configuration) for every knob.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("bootstrap", "build (or reuse) the embedded default model: a tiny Qwen2 warm-started by SFT"),
        ("eval", "pass@1, pass@k and malformed rate of a checkpoint on a dataset or task split"),
        ("train", "RL training run (default: C3PO, N=4 slots, on the embedded default, local Ray)"),
    ]:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--config", default=None, help="recipe: a TOML file or a name in deploy/configs")
        p.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("--debug", action="store_true", help="show the traceback of an input error")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "train":
            p.add_argument("--resume", nargs="?", const="auto", default=None,
                           help="resume from a run directory (or 'auto': the newest run of this name)")
    args = parser.parse_args(argv)

    from threepo.deploy.config import ConfigError
    from threepo.services.bootstrap import BootstrapFailed
    from threepo.services.errors import UserInputError

    try:
        return _dispatch(args)
    except (UserInputError, BootstrapFailed) as err:
        if args.debug:
            raise
        err = getattr(err, "cause", err)  # raised inside a Ray actor: its own message, not the remote traceback
        kind = "config error: " if isinstance(err, ConfigError) else ""
        print(f"threepo {args.command}: {kind}{err}", file=sys.stderr)
        return 2 if isinstance(err, UserInputError) else 1


def _dispatch(args: argparse.Namespace) -> int:
    from threepo.deploy.config import load_config, to_toml

    resume_dir = None
    if args.command == "train" and args.resume and "=" in args.resume and not os.path.exists(args.resume):
        args.overrides, args.resume = [args.resume, *args.overrides], "auto"  # `--resume key=value`
    if args.command == "train" and args.resume:
        from threepo.deploy.checkpoints import find_run_dir

        resume_dir = find_run_dir(args.resume, args)
        cfg = load_config(os.path.join(resume_dir, "config.toml"), args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.show_config:
        print(to_toml(cfg))
        return 0
    check_inputs(cfg)
    if args.command == "train":
        from threepo.deploy.run import main_train  # Ray and the roles: only once the input is known good

        return main_train(args, cfg, resume_dir)
    path = policy_path(cfg) if args.command == "eval" else None
    with run_directory(cfg, args.command) as run_dir:
        return cmd_eval(cfg, run_dir, path) if path else cmd_bootstrap(cfg, run_dir)


def check_inputs(cfg) -> None:
    """Check every path the config names (model, datasets), that its prompts can be built, and the
    verifier settings that depend on this machine before anything starts; raises `UserInputError`
    naming the key, file and line."""
    from threepo.services.datasets import run_items
    from threepo.services.errors import UserInputError
    from threepo.services.modeling import resolve_model
    from threepo.services.prompting import PromptEncoder
    from threepo.services.verifier_pool import auth_token
    from threepo.services.verifiers.base import available_verifiers

    auth_token(cfg.verifier.auth_env)
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
                             "verifier.route=[[\"code_output\", \"remote_sandbox\"]] and verifier.endpoints")


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
        from threepo.services.modeling import resolve_model

        return resolve_model(cfg.model.path)
    from threepo.services.bootstrap import BootstrapFailed, ensure_bootstrapped

    result = ensure_bootstrapped(cfg.model, cfg.task, cfg.bootstrap)
    if not result.reached_target:
        raise BootstrapFailed(result.failure(cfg.bootstrap))
    return result.path


def cmd_bootstrap(cfg, run_dir: str) -> int:
    import json

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
    import json

    from threepo.services.datasets import split_note

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

    from threepo.services.datasets import eval_items
    from threepo.services.engines.base import SamplerConfig
    from threepo.services.evaluation import Evaluator
    from threepo.services.verifier_pool import VerifierPool

    items = eval_items(cfg.data, cfg.task, cfg.eval)
    evaluator = Evaluator(path, items, VerifierPool(cfg.verifier.pool_config()), cfg.prompt,
                          SamplerConfig(threads=cfg.bootstrap.threads, batch_size=cfg.eval.batch_size, seed=cfg.seed,
                                        device=cfg.eval.device),
                          dtype=cfg.model.dtype, seed=cfg.seed)
    try:
        with tqdm(total=len(items), desc=label, unit="item") as bar:
            return evaluator.evaluate(samples_per_item=cfg.eval.samples_per_item, k=cfg.eval.k,
                                      temperature=cfg.eval.temperature, max_new_tokens=cfg.sampler.max_new_tokens,
                                      progress=bar.update)
    finally:
        evaluator.close()


if __name__ == "__main__":
    sys.exit(main())
