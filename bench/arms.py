"""Benches that compare arms of one script, each arm in its own process, rounds alternating
(the order turns each round: these machines drift). A script runs itself with ``--one ARM``
and prints one ``RESULT {json}`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence


def alternate(script: str, arms: Sequence[str], rounds: int, args: Sequence[str],
              env: Mapping[str, str] | None = None) -> Iterator[tuple[int, str, dict]]:
    """``(round, arm, result)`` of ``script --one ARM *args`` for each round (from 1) and arm."""
    for round_ in range(1, rounds + 1):
        for arm in arms if round_ % 2 else arms[::-1]:
            done = subprocess.run([sys.executable, script, "--one", arm, *args],
                                  capture_output=True, text=True, check=False, env=env)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{arm} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            yield round_, arm, json.loads(line[len("RESULT "):])
