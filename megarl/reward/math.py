"""Math answers checked with math-verify, under a time limit that holds from any thread or process.

Registered for data_source "math" and the aliases verl's default reward uses for math sets
(MATH_SOURCES, "aime*", "numina_*"), and "openai/gsm8k". The response's final answer is what
math-verify extracts (a \\boxed{} answer first, then "final answer is ...", then the last
expression; LaTeX, fractions and plain numbers alike); the ground truth is wrapped in \\boxed{}
unless it holds one. Equal values score 1 (\\frac{1}{2} = 0.5 = 1/2), anything else 0.

gsm8k: the ground truth may be the dataset's full solution; its answer is the number after the
last "####". A response's "#### N" is its answer when it has one, else math-verify's extraction.

Time limit: math-verify's own uses signal.alarm, which raises outside a process's main thread
(a reward scored from a thread pool, a Ray actor's threads). Here parsing and comparing run in
worker processes (megarl.reward.math_worker, started with subprocess, so a daemonic
multiprocessing worker may use them too); the caller waits at most `timeout_s` and kills a worker
that overruns, which stops even a sympy computation that never returns. A new worker replaces it
on the next call. Answers that time out, have nothing parsable, or make math-verify raise score 0
and are counted (megarl.reward.take_counts: reward/timeouts, reward/unparsable,
reward/verifier_errors; a ground truth math-verify cannot read: reward/gold_unparsable).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from megarl.reward.registry import RewardError, count, register_scorer, register_scorer_family

DEFAULT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # importing sympy and math-verify on a loaded machine
MATH_SOURCES = (
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math_dapo_reasoning",
)
MATH_PREFIXES = ("aime", "numina_")
GSM8K_SOURCE = "openai/gsm8k"

log = logging.getLogger(__name__)


class _Worker:
    """One math_worker process; ask() sends one request and waits for its reply."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the megarl package
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megarl.reward.math_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        if self._reply(START_TIMEOUT_S) is None:
            self.kill()
            raise RewardError(f"the math verifier's worker did not start within {START_TIMEOUT_S:.0f} s")

    def ask(self, response: str, gold: str, timeout_s: float) -> dict | None:
        """The worker's reply, or None when it took longer than timeout_s (the worker is killed)."""
        self.proc.stdin.write((json.dumps({"response": response, "gold": gold}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._reply(timeout_s)
        if reply is None:
            self.kill()
        return reply

    def _reply(self, timeout_s: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RewardError(
                f"the math verifier's worker exited with code {code} (its stderr is "
                "above; is math-verify installed? scripts/setup_env.sh installs it)"
            )
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class MathVerifier:
    """A pool of up to `max_workers` worker processes, started on demand, shared by threads."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = 4):
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"MathVerifier needs timeout_s > 0 and max_workers >= 1, got {timeout_s}, {max_workers}")
        self.timeout_s, self.max_workers = timeout_s, max_workers
        self.pid = os.getpid()  # a forked child must not use its parent's pipes
        self._idle: list[_Worker] = []
        self._running = 0
        self._free = threading.Condition()

    def check(self, response: str, gold: str) -> dict:
        """{"status": correct|wrong|unparsable|gold_unparsable|error|timeout, "detail": str}."""
        worker = self._acquire()
        reply = None
        try:
            reply = worker.ask(response, gold, self.timeout_s)
        finally:
            self._release(worker if reply is not None else None)
        if reply is None:
            return {"status": "timeout", "detail": f"response ends {response[-80:]!r}"}
        return reply

    def _acquire(self) -> _Worker:
        with self._free:
            while not self._idle and self._running >= self.max_workers:
                self._free.wait()
            self._running += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Worker()  # outside the lock: a start takes seconds
        except BaseException:
            self._release(None)
            raise

    def _release(self, worker: _Worker | None) -> None:
        with self._free:
            self._running -= 1
            if worker is not None and worker.alive():
                self._idle.append(worker)
            self._free.notify()

    def close(self) -> None:
        """Stop the idle workers (busy ones stop when they are next released and fail)."""
        with self._free:
            idle, self._idle = self._idle, []
        if os.getpid() == self.pid:
            for worker in idle:
                worker.kill()


_verifier: MathVerifier | None = None
_verifier_lock = threading.Lock()
_settings = {"timeout_s": DEFAULT_TIMEOUT_S, "max_workers": 4}


def configure(timeout_s: float | None = None, max_workers: int | None = None) -> None:
    """Set this process's math time limit (seconds per answer) and worker count; the workers are
    replaced only when a setting changes."""
    global _verifier
    with _verifier_lock:
        before = dict(_settings)
        if timeout_s is not None:
            _settings["timeout_s"] = float(timeout_s)
        if max_workers is not None:
            _settings["max_workers"] = int(max_workers)
        if _settings == before:
            return
        old, _verifier = _verifier, None
    if old is not None:
        old.close()


def verifier() -> MathVerifier:
    """This process's MathVerifier (made on first use, and again in a forked child)."""
    global _verifier
    with _verifier_lock:
        if _verifier is None or _verifier.pid != os.getpid():
            _verifier = MathVerifier(**_settings)
        return _verifier


@atexit.register
def _close() -> None:
    if _verifier is not None:
        _verifier.close()


_COUNTER = {
    "timeout": "reward/timeouts",
    "unparsable": "reward/unparsable",
    "gold_unparsable": "reward/gold_unparsable",
    "error": "reward/verifier_errors",
}
_warned: set[str] = set()


def verify_math(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals the ground truth, else 0.0 (counted when not
    judged: see the module docstring). Usable from a custom reward function."""
    started = time.perf_counter()
    reply = verifier().check(response, ground_truth)
    status = reply["status"]
    if status in _COUNTER:
        count(_COUNTER[status])
        if status not in _warned and status != "unparsable":  # a model's non-answer is routine
            _warned.add(status)
            log.warning(
                "math verifier: %s after %.1f s (%s); scored 0 and counted as %s (logged once per kind)",
                status,
                time.perf_counter() - started,
                reply["detail"],
                _COUNTER[status],
            )
    return 1.0 if status == "correct" else 0.0


def math_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return verify_math(solution_str, ground_truth)


for _source in MATH_SOURCES:
    register_scorer(_source)(math_score)
for _prefix in MATH_PREFIXES:
    register_scorer_family(_prefix, lambda data_source: math_score)

_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last "####" (commas dropped), or None."""
    found = _HASHES.findall(text)
    return found[-1].replace(",", "") if found else None


@register_scorer(GSM8K_SOURCE)
def gsm8k_score(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    gold = gsm8k_answer(ground_truth) or ground_truth.strip()
    answer = gsm8k_answer(solution_str)
    return verify_math(solution_str if answer is None else answer, gold)
