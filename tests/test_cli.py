"""The command-line entry points run and say what they should."""
import json
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
    p = _run("-m", "zeronb.bench", "dispatch", "--world-sizes", "1", "2", "--calls", "20", "--rounds", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^first pool of the process .*: [\d.]+ s$", p.stdout, re.M), p.stdout
    num = r"\s+([\d.]+)"
    rows = re.findall(rf"^\s+(\d){num}s{num}s{num}ms{num}ms{num}ms{num}s{num}s{num}x{num}x$", p.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"], p.stdout
    for _, start, restart, first50, median, p90, spawn, torchrun, per_start, per_call in rows:
        assert 0 < float(median) <= float(p90) and float(start) > 0 and float(restart) > 0
        assert float(spawn) > 0 and float(torchrun) > 0 and float(per_call) > 1
    assert re.search(r"pool start ~\s+-?\d+ ms \+\s+-?\d+ ms per rank", p.stdout), p.stdout


def test_every_path_of_the_train_cli_reports_the_same_fields(tmp_path):
    from zeronb.train.cli import main

    reports = {}
    for name, argv in {"one process": ["--nproc", "1", "--stage", "0"],
                       "stage 2 pool": ["--nproc", "2", "--stage", "2", "--grad-accum", "2", "--clip", "1"]}.items():
        assert main([*argv, "--steps", "2", "--report", str(tmp_path / "r.json")]) == 0
        reports[name] = json.load(open(tmp_path / "r.json"))
    one, pool = reports["one process"], reports["stage 2 pool"]
    assert set(one) == set(pool) and set(one["ranks"][0]) == set(pool["ranks"][0])
    assert one["ranks"][0]["bytes"]["grads"] > 0  # the reference keeps its gradients, as DDP does
    assert pool["grad_accum"] == 2 and pool["clip_norm"] == 1.0 and pool["ranks"][0]["grad_norm"] > 0


def test_bench_zero_measures_accumulation_and_bf16_reduction_per_stage():
    p = _run("-m", "zeronb.bench", "zero", "--world-size", "2", "--models", "mlp", "--rounds", "1", "--steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    num, opt = r"\s+([\d.]+)", r"\s+([\d.]+|-)"
    rows = re.findall(rf"^\s+mlp\s+(\d)\s+(plain|accum 4, every|accum 4, last|bf16 reduce){num}{num}{opt}{opt}{opt}{opt}{num}$",
                      p.stdout, re.M)
    got = {(int(stage), variant): dict(zip(("sent", "x_sent", "wire", "x_wire", "between", "per_psi", "ms"), values))
           for stage, variant, *values in rows}
    assert len(got) == 16, p.stdout  # 4 stages x 4 variants
    for stage in range(4):
        assert float(got[stage, "bf16 reduce"]["x_sent"]) < 0.9  # the gradients' bytes halve
        assert got[stage, "plain"]["between"] == "-" and got[stage, "accum 4, last"]["between"] != "-"
    assert float(got[0, "accum 4, every"]["x_sent"]) == 4.0 and float(got[0, "accum 4, last"]["x_sent"]) == 1.0
    assert float(got[0, "bf16 reduce"]["x_sent"]) == 0.5
    # ZeRO-1 syncing every micro-batch: 4 reduce-scatters and 1 all-gather where the plain step has one of each
    assert float(got[1, "accum 4, every"]["x_sent"]) == 2.5 and float(got[1, "accum 4, last"]["x_sent"]) == 1.0
    # ZeRO-2 and ZeRO-3: syncing every micro-batch holds shards between micro-batches, the other the whole gradient
    for stage in (2, 3):
        assert float(got[stage, "accum 4, every"]["per_psi"]) < 0.6 <= 1.0 <= float(got[stage, "accum 4, last"]["per_psi"])
    if got[0, "plain"]["wire"] != "-":  # gloo on Linux: the OS's count agrees on DDP's ratio
        assert 3.8 < float(got[0, "accum 4, every"]["x_wire"]) < 4.2


def test_sgd_on_four_ranks_equals_one_process_for_every_stage_and_impl(tmp_path):
    """`python -m zeronb.train --optimizer sgd --stage S --nproc 4 --model gpt --dtype float64` against
    `--nproc 1 --stage 0 --optimizer sgd`, the files the command line saves compared."""
    import torch

    from zeronb.train import max_diff
    from zeronb.train.cli import main

    common = ["--optimizer", "sgd", "--model", "gpt", "--dtype", "float64"]
    assert main([*common, "--nproc", "1", "--stage", "0", "--save-params", str(tmp_path / "one.pt")]) == 0
    one = torch.load(tmp_path / "one.pt")
    for stage in range(4):
        for impl in ("zeronb", "torch"):
            out = tmp_path / f"{stage}{impl}.pt"
            assert main([*common, "--nproc", "4", "--stage", str(stage), "--impl", impl, "--save-params", str(out)]) == 0
            assert max_diff(torch.load(out), one) <= 1e-10, (stage, impl)


def test_the_train_cli_runs_on_paced_nodes_and_reports_bytes_by_node(tmp_path):
    out = tmp_path / "r.json"
    p = _run("-m", "zeronb.train", "--nproc", "4", "--nodes", "2", "--inter-node-bandwidth", "100MB/s", "--stage", "3",
             "--hpz", "--steps", "2", "--report", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(out.read_text())
    assert report["nodes"] == 2 and report["hpz"] and report["inter_node_bandwidth"] == "100MB/s"
    for r in report["ranks"]:
        assert r["wire_within_node"] > 0 and r["wire_across_nodes"] > 0
        assert r["wire_within_node"] + r["wire_across_nodes"] == r["wire_bytes_per_step"]
    bad = _run("-m", "zeronb.train", "--nproc", "4", "--nodes", "3")
    assert bad.returncode != 0 and "nodes must be a positive number that divides" in bad.stderr, bad.stderr
