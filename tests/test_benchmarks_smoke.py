"""Smoke run of the benchmarks' smallest setting: P1 (raytrain vs bare torchrun FSDP2) runs
end to end from its one command and prints its ratio lines. Timings are never asserted:
this machine is shared; the figures live in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_p1_smoke_prints_sane_ratio_lines(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "p1", "--smoke", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout

    # The header names the setting, the machine's load and the exact command.
    assert "command: python -m benchmarks.bench p1 --smoke" in text and "load average" in text

    # The arms did the same work: same model, data order and loss give the same first loss.
    same = next((ln for ln in text.splitlines() if ln.startswith("P1 same work")), "")
    losses = dict(re.findall(r"([\w-]+) (\d+\.\d+)", same))
    assert {"raytrain", "torchrun"} <= set(losses), text
    assert all(math.isclose(float(v), float(losses["torchrun"]), rel_tol=1e-4) for v in losses.values()), same

    # The ratio lines: medians of both arms and a positive, finite ratio.
    for name in ("P1 step period (wall", "P1 in-loop step time"):
        line = next((ln for ln in text.splitlines() if ln.startswith(name)), None)
        assert line, f"no {name!r} line in:\n{text}"
        ratio = float(re.search(r"= ratio (\S+)", line).group(1))
        assert 0 < ratio < 100 and math.isfinite(ratio), line
        assert "torchrun median" in line
    assert re.search(r"^SUMMARY p1: ratio \d+\.\d+", text, re.M), text

    figures = json.loads(out.read_text())
    p1 = figures["results"]["p1"]
    assert figures["setting"]["name"] == "smoke" and len(figures["load_average"]) == 3
    assert all(v > 0 for arm in p1["periods"].values() for v in arm), p1
