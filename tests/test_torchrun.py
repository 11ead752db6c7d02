"""The training script under torchrun - 2 nodes x 2 processes on loopback, c10d rendezvous - gives
the same final parameters as the same run on the notebook's pool of 4 ranks."""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from zeronb.pool.launch import loopback_interface
from zeronb.train.parity import max_diff

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(meet, train_argv):
    """torchrun on 2 nodes x 2 processes on loopback, meeting as `meet` says; both must succeed."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=loopback_interface(), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), *meet,
                               "--max-restarts", "0", "-m", "zeronb.train", *train_argv],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(logs)[-4000:]


def _train_args(stage, out):
    return ["--stage", str(stage), "--model", "gpt", "--precision", "float64", "--steps", "3", "--save-params", out]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
# what differs under torchrun is the launch (the rendezvous, the environment, the nodes), not a stage's own
# code: DDP and ZeRO-3, the stages that hook backward the most and the least, under both rendezvous (stages 1
# and 2 run the same launch; their parity with one process is test_zero's, on the pool)
@pytest.mark.parametrize("stage,rdzv", [(0, "c10d"), (3, "c10d"), (3, "static")])
def test_two_nodes_under_torchrun_match_the_pool(stage, rdzv, tmp_path):
    pool_out, run_out = str(tmp_path / "pool.pt"), str(tmp_path / "torchrun.pt")
    subprocess.run([sys.executable, "-m", "zeronb.train", "--nproc", "4", *_train_args(stage, pool_out)],
                   check=True, capture_output=True, timeout=300)
    port = _free_port()
    if rdzv == "c10d":
        meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zeronb-{stage}"]
    else:  # the static rendezvous: node 0 hosts the store at --master-addr:--master-port
        meet = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    _two_nodes(meet, _train_args(stage, run_out))
    err = max_diff(torch.load(pool_out), torch.load(run_out))  # (it refuses two sets of names)
    assert err <= 1e-12, f"stage {stage}: torchrun and the pool differ by {err}"


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
@pytest.mark.parametrize("extra", [["--stage", "3", "--shard-group", "node"], ["--stage", "3", "--hpz"],
                                   ["--stage", "2", "--impl", "torch", "--shard-group", "node"]], ids=" ".join)
def test_the_node_options_under_torchrun_take_its_nodes_and_match_the_pool(extra, tmp_path):
    """On 2 nodes x 2 under torchrun the nodes come from LOCAL_WORLD_SIZE; on the pool from --nodes 2."""
    pool_out, run_out = str(tmp_path / "pool.pt"), str(tmp_path / "torchrun.pt")
    argv = ["--model", "gpt", "--precision", "float64", "--steps", "3", *extra]
    subprocess.run([sys.executable, "-m", "zeronb.train", "--nproc", "4", "--nodes", "2", *argv, "--save-params", pool_out],
                   check=True, capture_output=True, timeout=300)
    meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "zeronb-nodes"]
    _two_nodes(meet, [*argv, "--save-params", run_out])
    err = max_diff(torch.load(pool_out), torch.load(run_out))
    assert err <= 1e-12, f"{extra}: torchrun and the pool differ by {err}"


# (not --reduce-dtype: reducing float64 gradients in fp32 or bf16 rounds them, by design)
PRACTICE = ["--grad-accum", "2", "--accum-sync", "last", "--clip", "0.05", "--activation-checkpointing"]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found")
@pytest.mark.parametrize("impl,stage", [("zeronb", 3), ("torch", 2)])
def test_training_in_practice_under_torchrun_checkpoints_and_resumes_on_a_pool(impl, stage, tmp_path):
    """Under torchrun (2 nodes x 2), with accumulation, clipping and activation checkpointing:
    save after 2 steps; resume on a pool of 2 ranks to 4 steps; equal to one process."""
    from zeronb.train.cli import parse_args
    from zeronb.train import run, train_single

    ckpt = str(tmp_path / "ckpt")
    argv = ["--stage", str(stage), "--impl", impl, "--model", "gpt", "--precision", "float64", *PRACTICE]
    meet = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", f"practice-{impl}"]
    _two_nodes(meet, [*argv, "--steps", "2", "--checkpoint", ckpt])
    resumed = run(parse_args([*argv, "--nproc", "2", "--steps", "4", "--resume", ckpt]))  # the same flags, parsed
    reference = train_single(parse_args(["--model", "gpt", "--precision", "float64", "--clip", "0.05", "--steps", "4"]))
    assert max_diff(resumed.params, reference.params) <= 1e-10
