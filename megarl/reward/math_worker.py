"""The math verifier's worker process: parse and compare answers with math-verify, one per line.

Run by megarl.reward.math as `python -m megarl.reward.math_worker`. It reads JSON requests
{"response": str, "gold": str} from stdin, one per line, and answers each with one JSON line
{"status": "correct" | "wrong" | "unparsable" | "gold_unparsable" | "error", "detail": str}.
It prints {"status": "ready"} once math-verify is imported, and exits when stdin closes.

math-verify's own time limits use signal.alarm, which works only in a process's main thread;
here both are off (parsing_timeout=None, timeout_seconds=None) and the parent enforces its limit
by killing this process, which stops even a sympy computation that never returns.
"""

from __future__ import annotations

import functools
import json
import logging
import sys


def _load():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # the warning says we bring our own time limit, which we do (the parent kills this process)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_targets = [LatexExtractionConfig()]
    response_targets = [LatexExtractionConfig(), ExprExtractionConfig()]

    @functools.lru_cache(maxsize=4096)  # every sample of a group shares its ground truth
    def parse_gold(gold: str):
        text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
        return parse(text, extraction_config=gold_targets, parsing_timeout=None)

    def check(response: str, gold: str) -> dict:
        gold_parsed = parse_gold(gold)
        if not gold_parsed:
            return {"status": "gold_unparsable", "detail": gold[:200]}
        answer = parse(response, extraction_config=response_targets, parsing_timeout=None)
        if not answer:
            return {"status": "unparsable", "detail": ""}
        correct = verify(gold_parsed, answer, timeout_seconds=None)
        return {"status": "correct" if correct else "wrong", "detail": str(answer[-1])[:200]}

    return check


def main() -> None:
    check = _load()
    out = sys.stdout
    out.write(json.dumps({"status": "ready"}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = check(request["response"], request["gold"])
        except Exception as exc:  # noqa: BLE001  (reported to the parent, which counts and logs it)
            reply = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
