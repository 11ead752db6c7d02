"""Check a GPU box end to end, and print what ran where: `bash scripts/gpu_check.sh` runs this.

1. `python -m zeronb doctor`: versions, devices, the backend `auto` picks, a smoke all-reduce;
2. the GPU tests (tests/test_gpu.py: NCCL on as many GPUs as there are, up to 4);
3. every chapter through nbval (the chapters use 2-6 ranks: NCCL where there are that many GPUs,
   gloo on the CPU otherwise, as each chapter's first output says);
4. the train CLI for every stage and impl (zeronb's, PyTorch's, DeepSpeed's stages 1-3), Adam and
   SGD, on min(GPUs, 4) ranks against one process on the whole batch (float64; DeepSpeed, whose
   optimizer keeps float32 partitions, in float32 against a float32 process, within 1e-5).
Then a table: each step, the backend and devices it used, whether it passed, and its figures.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def sh(*args, timeout=3600):
    t0 = time.perf_counter()
    p = subprocess.run([PY, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p, time.perf_counter() - t0


def pytest_counts(out: str) -> str:
    m = re.findall(r"(\d+ (?:passed|failed|skipped|errors?))", out.strip().splitlines()[-1] if out.strip() else "")
    return ", ".join(m) or "no summary"


def main(argv=None) -> int:
    import argparse

    from zeronb.runtime.backend import choose_backend, cuda_device_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="doctor,tests,chapters,train",
                        help="which steps to run, comma-separated (default: all of them)")
    parser.add_argument("--impls", default="zeronb,torch,deepspeed", help="the train step's implementations")
    args = parser.parse_args(argv)
    parts, impls = set(args.parts.split(",")), args.impls.split(",")

    gpus = cuda_device_count()
    if gpus == 0:
        print("gpu_check: no CUDA GPU visible here; on a CPU machine run `bash scripts/test.sh`")
        return 2
    n = min(gpus, 4)
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    print(f"gpu_check: torch {torch.__version__}, {gpus} GPU(s) ({', '.join(names)}), "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    for ranks in sorted({1, 2, n, 4}):
        print(f"  auto, {ranks} rank(s): {choose_backend(ranks)[1]}")
    rows = Rows()

    if "doctor" in parts:
        p, s = sh("-m", "zeronb", "doctor")
        print(p.stdout)
        smoke = re.search(r"smoke test\s+(.*)", p.stdout)
        rows.append(("doctor", choose_backend(2)[0], "smoke all-reduce, 2 ranks", p.returncode == 0,
                     smoke.group(1) if smoke else p.stdout[-200:], s))

    if "tests" in parts:
        p, s = sh("-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-m", "gpu", "tests/test_gpu.py")
        print(p.stdout[-8000:])
        rows.append(("GPU tests", "nccl", f"cuda:0..{n - 1}", p.returncode == 0, pytest_counts(p.stdout), s))

    for nb in sorted(os.listdir(os.path.join(ROOT, "notebooks"))) if "chapters" in parts else ():
        if not nb.endswith(".ipynb"):
            continue
        p, s = sh("-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
                  f"notebooks/{nb}")
        if p.returncode:
            print(p.stdout[-4000:])
        rows.append((f"chapter {nb[:-6]}", choose_backend(4)[0], "auto per pool", p.returncode == 0,
                     pytest_counts(p.stdout) + " cells", s))

    with tempfile.TemporaryDirectory() as tmp:
        if "train" not in parts:
            return _table(rows)
        from zeronb.train.parity import max_diff

        for optimizer in ("adam", "sgd"):
            for precision in ("float64", "float32"):
                want = [i for i in impls if (i == "deepspeed") == (precision == "float32")]
                if not want:
                    continue
                common = ["--model", "gpt", "--precision", precision, "--steps", "3", "--optimizer", optimizer]
                p, s = sh("-m", "zeronb.train", "--nproc", "1", "--stage", "0", *common,
                          "--save-params", f"{tmp}/ref.pt", "--report", f"{tmp}/ref.json")
                ref = torch.load(f"{tmp}/ref.pt") if p.returncode == 0 else None
                rows.append((f"train, 1 process, {optimizer} {precision}", choose_backend(1)[0],
                             _devices(f"{tmp}/ref.json"), p.returncode == 0,
                             _figures(f"{tmp}/ref.json") if p.returncode == 0 else p.stderr[-300:], s))
                for impl in want:
                    for stage in range(1 if impl == "deepspeed" else 0, 4):
                        p, s = sh("-m", "zeronb.train", "--nproc", str(n), "--stage", str(stage), "--impl", impl,
                                  *common, "--save-params", f"{tmp}/p.pt", "--report", f"{tmp}/r.json")
                        good, figures = p.returncode == 0 and ref is not None, p.stderr[-300:]
                        if good:
                            err = max_diff(torch.load(f"{tmp}/p.pt"), ref)
                            good = err <= (1e-10 if precision == "float64" else 1e-5)
                            figures = f"max |diff| vs 1 process {err:.1e}; " + _figures(f"{tmp}/r.json")
                        rows.append((f"train, stage {stage} {impl}, {optimizer}", choose_backend(n)[0],
                                     _devices(f"{tmp}/r.json"), good, figures, s))

    return _table(rows)


class Rows(list):
    """The table's rows, each also printed as it comes (a check cut short by a timeout still shows
    what it finished)."""

    def append(self, row):
        what, backend, devices, passed, figures, seconds = row
        print(f"  {'pass' if passed else 'FAIL'}: {what} ({backend}, {devices}, {seconds:.1f} s) {figures}", flush=True)
        super().append(row)


def _table(rows) -> int:
    ok = True
    print(f"\n{'what':<32} {'backend':<8} {'devices':<22} {'result':<6} {'seconds':>7}  figures")
    for what, backend, devices, passed, figures, seconds in rows:
        ok &= passed
        print(f"{what:<32} {backend:<8} {devices:<22} {'pass' if passed else 'FAIL':<6} {seconds:>7.1f}  {figures}")
    return 0 if ok else 1


def _devices(report_path) -> str:
    try:
        ranks = json.load(open(report_path))["ranks"]
    except (OSError, ValueError, KeyError):
        return "?"
    devs = [r.get("device", "?") for r in ranks]
    return devs[0] if len(devs) == 1 else f"{devs[0]}..{devs[-1]}"


def _figures(report_path) -> str:
    r0 = json.load(open(report_path))["ranks"][0]
    held = sum(r0["bytes"].values()) / 1024
    peak = f", CUDA peak {r0['cuda_peak'] / 2**20:.1f} MiB" if r0.get("cuda_peak") else ""
    return f"rank 0 holds {held:.1f} KiB{peak}, {r0['step_ms']:.1f} ms/step"


if __name__ == "__main__":
    sys.exit(main())
