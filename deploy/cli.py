"""The `threepo` command line: `bootstrap`, `eval`, `train` (the entry point; nothing imports it:
what each subcommand does is in deploy/commands.py).

Every subcommand takes `--config RECIPE` (a TOML file or a shipped recipe name) and overrides
`section.field=value`; `threepo <cmd> --show-config` prints the resolved config with each setting's
meaning (deploy/settings_doc.py) and exits. Heavy imports happen inside the subcommands so that
`threepo --help` stays instant.

Errors: a user mistake (`UserInputError`: a config key, a path, a dataset line) is one line naming
it and what was expected, exit 2, checked before anything heavy is imported or any run directory is
made; a bootstrap that misses its target is one line, exit 1. `--debug` shows the traceback
instead. A command that fails leaves no run directory holding nothing but its config.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="threepo",
        description="Asynchronous RL with verifiable rewards, exploring in parameter space.",
        epilog="Overrides look like sampler.temperature=0.7 or algo.exploration=none; "
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
        p.add_argument("--show-config", action="store_true", help="print the resolved config, each setting's meaning above it, and exit")
        p.add_argument("--debug", action="store_true", help="show the traceback of an input error")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "train":
            p.add_argument("--resume", nargs="?", const="auto", default=None,
                           help="resume from a run directory (or 'auto': the newest run of this name)")
    # overrides may stand on both sides of an option (`train a.b=1 --config grpo_baseline c.d=2`): argparse
    # collects one run of positionals, so the ones after an option come back here, in their order
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]

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
    from threepo.deploy.commands import check_inputs, cmd_bootstrap, cmd_eval, cmd_train, policy_path, run_directory
    from threepo.deploy.config import load_config

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
        from threepo.deploy.settings_doc import documented_toml

        print(documented_toml(cfg), end="")
        return 0
    check_inputs(cfg)
    if args.command == "train":
        return cmd_train(cfg, resume_dir)
    path = policy_path(cfg) if args.command == "eval" else None
    with run_directory(cfg, args.command) as run_dir:
        return cmd_eval(cfg, run_dir, path) if path else cmd_bootstrap(cfg, run_dir)


if __name__ == "__main__":
    sys.exit(main())
