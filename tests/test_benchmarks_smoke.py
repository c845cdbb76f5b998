"""Smoke run of the benchmarks' smallest setting: P1 (raytrain vs bare torchrun FSDP2) runs
end to end from its one command and prints its ratio lines. Timings are never asserted:
this machine is shared; the figures live in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_p1_smoke_prints_sane_ratio_lines(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "p1", "--smoke", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "BENCH_CACHE": str(tmp_path / "cache")},
    )  # nothing from an earlier run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout

    # The header names the setting, the machine's load and the exact command.
    assert "command: python -m benchmarks.bench p1 --smoke" in text and "load average" in text

    # The arms did the same work: same model, data order and loss give the same first loss.
    same = next((ln for ln in text.splitlines() if ln.startswith("P1 same work")), "")
    losses = dict(re.findall(r"([\w-]+) (\d+\.\d+)", same))
    assert {"raytrain", "torchrun"} <= set(losses), text
    assert all(math.isclose(float(v), float(losses["torchrun"]), rel_tol=1e-4) for v in losses.values()), same

    # The ratio lines: each ratio is its two medians' quotient, and the period's medians are those of
    # the per-run figures the JSON keeps (what RESULTS.md quotes is what was measured).
    figures = json.loads(out.read_text())
    p1 = figures["results"]["p1"]
    for name, series in (("P1 step period (wall", p1["periods"]), ("P1 in-loop step time", p1["in_loop"])):
        line = next((ln for ln in text.splitlines() if ln.startswith(name)), None)
        assert line, f"no {name!r} line in:\n{text}"
        num, den, ratio = map(
            float, re.search(r"raytrain median (\S+) s .*/ torchrun median (\S+) s .*= ratio (\S+)", line).groups()
        )
        assert math.isclose(ratio, num / den, rel_tol=2e-3, abs_tol=1e-3), line
        assert math.isclose(num, statistics.median(series["raytrain"]), abs_tol=1e-4), (line, series)
        assert math.isclose(den, statistics.median(series["torchrun"]), abs_tol=1e-4), (line, series)
    assert math.isclose(
        p1["ratio"],
        statistics.median(p1["periods"]["raytrain"]) / statistics.median(p1["periods"]["torchrun"]),
        rel_tol=1e-9,
    )
    assert re.search(r"^SUMMARY p1: ratio \d+\.\d+", text, re.M), text

    assert figures["setting"]["name"] == "smoke" and len(figures["load_average"]) == 3
    assert all(v > 0 for arm in p1["periods"].values() for v in arm), p1
