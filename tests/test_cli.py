"""The command-line entry points run and say what they should."""
import re
import subprocess
import sys


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_doctor():
    p = _run("-m", "zeronb", "doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^torch\s+\d+\.\d+", p.stdout, re.M)
    assert "gloo" in p.stdout
    assert re.search(r"auto, 2 ranks: (gloo|nccl)", p.stdout)
    assert re.search(r"smoke test\s+all-reduce .* correct, [\d.]+ ms", p.stdout)


def test_bench_dispatch_prints_its_table():
    p = _run("-m", "zeronb.bench", "dispatch", "--calls", "20", "--spawns", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = re.findall(r"^\s+(\d)\s+([\d.]+)s\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)s\s+(\d+)x$", p.stdout, re.M)
    assert [r[0] for r in rows] == ["2", "4"], p.stdout
    for _, start, median, p90, spawn, ratio in rows:
        assert 0 < float(median) <= float(p90) and float(spawn) > 0 and int(ratio) > 1
