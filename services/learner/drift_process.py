"""A process beside the learner for the start-of-step forwards that only the drift diagnostic needs.

On a CPU box the learner's update takes one core. The drift diagnostic's no-grad forward at a slot
(services/learner/proximal.py) would take the learner's own time inline; in a thread it would share the
interpreter lock and the core with the update (measured: no faster than inline). `DriftProcess` runs
it in a Python process of its own, on the core the sampler engine leaves idle:
- the process loads its own copy of the model from the learner's checkpoint;
- each step the learner writes (m, σ) into two fp32 buffers that both processes map (a file in
  /dev/shm, unlinked as soon as the learner has mapped it; the process maps it through the file
  descriptor it inherits, so nothing is left behind however either process ends) and sends the
  rows through the process's stdin;
- `start` returns a `Pending`, which the learner joins before its first optimizer step moves (m, σ).

Results do not depend on timing. Until the process has loaded its model the learner computes these
forwards inline, and either way they are the same computation. An error in the process fails the
step, and so does a process that dies. The process exits when its stdin closes (the learner closed
it, or died).

Protocol, pickle frames on the process's stdin and stdout:
- init: {model_path, names, shapes, fd, temperature, chunk, bf16}; the process answers ("ready", None);
- then per step a list of ((seed, scale), rows, input_ids, attn, mask, targets, run), answered
  ("ok", [((seed, scale), rows, logp)]) or ("error", traceback).
"""

from __future__ import annotations

import math
import os
import pickle
import select
import subprocess
import sys
import tempfile
import traceback
import weakref
from collections.abc import Callable

import torch


class Pending:
    """Start-of-step log-probs being computed beside the update; `join` waits for them and files
    them into the step's `StartLogprobs` (once; a later join does nothing). Errors propagate."""

    def __init__(self, fetch: Callable[[], list] | None = None) -> None:
        self.fetch = fetch

    def join(self, start) -> None:
        if self.fetch is not None:
            fetch, self.fetch = self.fetch, None
            for (seed, scale), rows, logp in fetch():
                start.put(seed, rows, logp, scale)


class DriftProcess:
    """No-grad token log-probs at posterior samples θ̂(seed, c) = m + c · σ ⊙ z(seed), computed by
    a process of its own on its copy of the model at `model_path` (`named`: the learner's trainable
    parameters, whose m and σ it is sent; `noise_rank`: z's rank per matrix, 0 full)."""

    def __init__(self, model_path: str, named: list[tuple[str, torch.Tensor]], temperature: float,
                 chunk: int = 0, bf16: bool = False, noise_rank: int = 0) -> None:
        self.names, shapes = [n for n, _ in named], [tuple(p.shape) for _, p in named]
        total = sum(p.numel() for _, p in named)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="threepo-beside-", dir=shm)
        try:  # the file has no name once mapped here: the process maps it through the descriptor it inherits
            os.ftruncate(fd, 2 * total * 4)
            flat = torch.from_file(path, shared=True, size=2 * total, dtype=torch.float32)
        finally:
            os.unlink(path)
        self.means, self.sigmas = _views(flat[:total], self.names, shapes), _views(flat[total:], self.names, shapes)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "threepo.services.learner.drift_process"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env, pass_fds=(fd,))
        finally:
            os.close(fd)
        self._stop = weakref.finalize(self, _stop, self.proc)
        self.ready, self.unanswered = False, 0
        self._send({"model_path": model_path, "names": self.names, "shapes": shapes, "fd": fd,
                    "temperature": temperature, "chunk": chunk, "bf16": bf16, "noise_rank": noise_rank})

    def is_ready(self, wait_s: float = 0.0) -> bool:
        """Whether the process has loaded its model, waiting at most `wait_s` for it."""
        if not self.ready and select.select([self.proc.stdout], [], [], wait_s)[0]:
            self._answer("ready")
            self.ready = True
        return self.ready

    def start(self, batch, points: dict, means: dict, sigmas: dict, run: Callable) -> Pending:
        """Sends ((seed, c), rows) of `points` with the rows of `batch` (`run(rows)`: their
        shared-prompt runs, as `prefix_forward.row_logprobs` takes them) and the current (m, σ)."""
        while self.unanswered:  # a step that failed before joining left its answer in the pipe
            self._answer("ok", discard=True)
        for name in self.names:
            self.means[name].copy_(means[name])
            if name in sigmas:  # σ of the noised tensors alone (MaskedSigma); zero elsewhere
                self.sigmas[name].copy_(sigmas[name])
            else:
                self.sigmas[name].zero_()
        self._send([(point, rows, batch.input_ids[rows], batch.attn[rows], batch.mask[rows], batch.targets[rows],
                     run(rows)) for point, rows in points.items()])
        self.unanswered += 1
        return Pending(lambda: self._answer("ok"))

    def close(self) -> None:
        """Stop the process (it exits on the end of its stdin)."""
        self._stop()

    def _send(self, message) -> None:
        try:
            pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._exited() from None

    def _answer(self, expected: str, discard: bool = False):
        try:
            kind, body = pickle.load(self.proc.stdout)
        except EOFError:
            raise self._exited() from None
        if kind in ("ok", "error"):
            self.unanswered -= 1
        if discard:
            return None
        if kind == "error":
            raise RuntimeError(f"the drift forward beside the update failed in its process:\n{body}")
        if kind != expected:
            raise RuntimeError(f"the drift forward beside the update: expected {expected!r}, got {kind!r}")
        return body


    def _exited(self) -> RuntimeError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"the drift forward beside the update: its process exited (code {code})")


def _views(flat: torch.Tensor, names: list[str], shapes: list[tuple]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in zip(names, shapes):
        n = math.prod(shape)
        out[name], at = flat[at:at + n].view(shape), at + n
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


def main() -> None:
    """The process: serves the learner's requests until its stdin ends."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr; stdout carries the frames only
    inp = sys.stdin.buffer
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the learner
    from threepo.algorithms.param_noise import load_perturbed
    from threepo.services.model.modeling import load_model
    from threepo.services.model.prefix_forward import row_logprobs

    init = pickle.load(inp)
    model = load_model(init["model_path"]).train().requires_grad_(False)  # the learner's mode
    params, names, shapes = dict(model.named_parameters()), init["names"], init["shapes"]
    total = sum(math.prod(s) for s in shapes)
    flat = torch.from_file(f"/proc/self/fd/{init['fd']}", shared=True, size=2 * total, dtype=torch.float32)
    os.close(init["fd"])  # mapped: the memory lives as long as one of the two processes does
    means, sigmas = _views(flat[:total], names, shapes), _views(flat[total:], names, shapes)
    named = [(n, params[n]) for n in names]

    def send(message) -> None:
        pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
    send(("ready", None))
    while True:
        try:
            points = pickle.load(inp)
        except EOFError:
            return
        try:
            done = []
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=init["bf16"], cache_enabled=False):  # as the learner
                for (seed, scale), rows, input_ids, attn, mask, targets, run in points:
                    load_perturbed(named, means, sigmas, seed, scale, init["noise_rank"])
                    logp = row_logprobs(model, input_ids, attn, mask, targets, run, init["temperature"], init["chunk"])
                    done.append(((seed, scale), rows, logp))
            send(("ok", done))
        except Exception:  # noqa: BLE001 (the learner raises it: the step fails, not this process)
            send(("error", traceback.format_exc()))


if __name__ == "__main__":
    main()
