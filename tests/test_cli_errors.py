"""Every input mistake a new user makes gets one line naming the key, file or line and what was
expected, exit code 2, no traceback (unless --debug), and no run directory left behind. The real
`threepo` command runs in a subprocess, as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "transformers")


def threepo(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "threepo.deploy.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def runs(tmp_path):
    path = tmp_path / "runs"
    path.mkdir()
    return path


def jsonl(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


ROW = json.dumps({"prompt": "Q: 1+1? A: ", "answer": "2"}).encode()


def test_config_errors_come_before_any_heavy_import():
    code = ("import sys; from threepo.deploy.cli import main; rc = main(['train', 'algo.bogus=1']); "
            f"print(rc, [m for m in {HEAVY!r} if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["2", "[]"], (result.stdout, result.stderr[-1000:])
    assert "algo.bogus" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["train", "eval"])
def test_missing_model_path(runs, command, tmp_path):
    one_line_error(threepo(command, "model.path=/no/such/model", f"runs_dir={runs}"),
                   "model.path='/no/such/model'", "no such directory", "expected")
    one_line_error(threepo(command, f"model.path={tmp_path}", f"runs_dir={runs}"),
                   "model.path=", "config.json")
    assert not list(runs.iterdir())


def test_missing_and_malformed_datasets(runs, tmp_path):
    one_line_error(threepo("train", "data.path=/no/such.jsonl", f"runs_dir={runs}"),
                   "data.path", "/no/such.jsonl", "no such file")
    bad = jsonl(tmp_path / "latin1.jsonl", ROW, ROW, '{"prompt": "caf\xe9", "answer": "1"}'.encode("latin-1"))
    one_line_error(threepo("train", f"data.path={bad}", f"runs_dir={runs}"),
                   "latin1.jsonl", "line 3", "not UTF-8", "0xe9")
    empty = jsonl(tmp_path / "empty.jsonl", b"", b"  ")
    one_line_error(threepo("eval", f"data.path={empty}", f"runs_dir={runs}"), "empty.jsonl", "no rows")
    no_answer = jsonl(tmp_path / "noanswer.jsonl", ROW, json.dumps({"prompt": "Q"}).encode())
    one_line_error(threepo("train", f"data.path={no_answer}", f"runs_dir={runs}"),
                   "noanswer.jsonl", "line 2", "'answer'", "non-empty string")
    unknown = jsonl(tmp_path / "verifier.jsonl", json.dumps({"prompt": "Q", "answer": "1", "verifier": "mth"}).encode())
    one_line_error(threepo("train", f"data.path={unknown}", f"runs_dir={runs}"),
                   "verifier.jsonl", "line 1", "'verifier'", "'math'")
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n")
    one_line_error(threepo("train", f"data.path={csv}", f"runs_dir={runs}"), "rows.csv", ".jsonl, .jsonl.gz or .parquet")
    one_line_error(threepo("eval", f"data.heldout_path={empty}", f"runs_dir={runs}"), "data.heldout_path")
    assert not list(runs.iterdir())


def test_resume_errors(runs, tmp_path):
    one_line_error(threepo("train", "--resume", "/no/such/run", f"runs_dir={runs}"),
                   "--resume /no/such/run", "no such directory")
    one_line_error(threepo("train", "--resume", str(tmp_path), f"runs_dir={runs}"), "config.toml")
    run = runs / "threepo-train-1"
    run.mkdir()
    (run / "config.toml").write_text("")
    one_line_error(threepo("train", "--resume", str(run)), "no complete checkpoint")
    one_line_error(threepo("train", "--resume", f"runs_dir={tmp_path / 'empty'}"),
                   "--resume auto", "no run of name 'threepo'")


def test_other_mistakes_a_new_user_makes(runs, tmp_path):
    one_line_error(threepo("train", "--config", "no_such_recipe"), "no_such_recipe", "shipped recipe")
    one_line_error(threepo("train", "runtime.steps"), "section.field=value")
    one_line_error(threepo("train", "runtime.steps=ten"), "runtime.steps", "expected int")
    one_line_error(threepo("train", "runtime.steps=0"), "runtime.steps", ">= 1")
    one_line_error(threepo("train", "task.family=chess"), "family", "arith")
    one_line_error(threepo("train", "--config", "grpo_baseline", "lora.rank=4", "learner.ranks=2"), "learner.ranks=1")
    env_var = "THREEPO_TEST_UNSET_TOKEN_VARIABLE"
    assert env_var not in os.environ
    one_line_error(threepo("train", f"sandbox.auth_env={env_var}"), "sandbox.auth_env", "not set")
    one_line_error(threepo("train", 'verifier.route=[["code_output", "remote_sandbx"]]'),
                   "verifier.route", "'remote_sandbx'", "remote_sandbox")
    a_file = tmp_path / "file"
    a_file.write_text("")
    one_line_error(threepo("eval", f"runs_dir={a_file}", "model.path=/no/such"), "model.path")
    assert not list(runs.iterdir())


def test_overrides_stand_on_either_side_of_an_option_and_keep_their_order(runs):
    result = threepo("train", "runtime.steps=5", "--config", "grpo_baseline", "runtime.steps=7", "lora.rank=2",
                     "--show-config")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\nsteps = 7\n" in result.stdout and "rank = 2" in result.stdout
    assert threepo("train", "--config", "grpo_baseline", "--bogus").returncode == 2


def test_debug_shows_the_traceback(runs):
    result = threepo("train", "model.path=/no/such/model", f"runs_dir={runs}", "--debug")
    assert result.returncode == 1 and "Traceback" in result.stderr and "MissingPathError" in result.stderr


def test_a_failed_command_leaves_no_empty_run_directory(tmp_path):
    from threepo.deploy.commands import run_directory
    from threepo.deploy.config import load_config

    cfg = load_config(None, [f"runs_dir={tmp_path}"])
    with pytest.raises(RuntimeError), run_directory(cfg, "eval") as run_dir:
        open(os.path.join(run_dir, "metrics.jsonl"), "w").close()  # created, never written
        raise RuntimeError("boom")
    assert not os.listdir(tmp_path)
    with pytest.raises(RuntimeError), run_directory(cfg, "eval") as run_dir:
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write('{"step": 1}\n')  # a run that got somewhere keeps its records
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == [os.path.basename(run_dir)]


def test_code_rows_without_bubblewrap_are_named_before_anything_starts(runs, tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with python but without bwrap
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bin_dir), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "threepo.deploy.cli", "train", "task.family=code",
                             f"runs_dir={runs}"], capture_output=True, text=True, timeout=120, env=env)
    one_line_error(result, "['code_output']", "bubblewrap", "remote_sandbox")
    assert not list(runs.iterdir())


def test_an_input_error_raised_inside_a_ray_actor_is_still_one_line(monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    from threepo.deploy import cli
    from threepo.services.verifiers.remote import SandboxAuthError

    remote = RayTaskError("VerifierActor.verify_batch", "Traceback (most recent call last):\n  ...",
                          SandboxAuthError("HTTP 401 from http://sandbox: refused; check sandbox.auth_env"))

    def dispatch(args):
        raise remote.as_instanceof_cause()
    monkeypatch.setattr(cli, "_dispatch", dispatch)
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert err == "threepo train: HTTP 401 from http://sandbox: refused; check sandbox.auth_env\n"


def test_real_model_mistakes_are_one_line(runs, tmp_path, tiny_dense_path):
    import shutil

    gsm = jsonl(tmp_path / "gsm.jsonl", json.dumps({"question": "How many?", "answer": "Two."}).encode())
    one_line_error(threepo("train", f"data.path={gsm}", "data.format=gsm8k", f"runs_dir={runs}"),
                   "data.path", "gsm.jsonl", "line 1", "'answer'", "#### <final answer>")
    one_line_error(threepo("eval", f"data.path={gsm}", "data.format=math", f"runs_dir={runs}"),
                   "unknown columns ['question'] for data.format=math")
    env = {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "threepo.deploy.cli", "eval", "model.path=SomeOrg/no-such-model",
                             f"runs_dir={runs}"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env, "HF_HOME": str(tmp_path / "hf")})
    one_line_error(result, "model.path='SomeOrg/no-such-model'", "not a local directory", "HF_HUB_OFFLINE=1")
    model = tmp_path / "no-system"  # a model whose chat template refuses a system message
    shutil.copytree(tiny_dense_path, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception("
                               "'System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_error(threepo("eval", f"model.path={model}", "prompt.system=Be brief.", f"runs_dir={runs}"),
                   "prompt.template='auto'", "cannot be applied with a system message", "System role not supported")
    one_line_error(threepo("eval", "prompt.template=/no/such.jinja", f"runs_dir={runs}"),
                   "prompt.template='/no/such.jinja'", "no such file")
    bare = tmp_path / "no-tokenizer"  # weights and config, but no tokenizer saved beside them
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_dense_path, name), bare / name)
    one_line_error(threepo("eval", f"model.path={bare}", f"runs_dir={runs}"),
                   f"model.path='{bare}'", "no tokenizer_config.json", "with its tokenizer")
    assert not list(runs.iterdir())
