"""Sharded checkpoints (zeronb.checkpoint, `--checkpoint` / `--resume`): a run saved on one number of
ranks and resumed on another trains on exactly as one uninterrupted process; each rank writes its
own part; the export is the model; bad resumes say what to do."""
import pytest
import torch

from zeronb import checkpoint
from zeronb.train import RunConfig, max_diff, run, train_single
from zeronb.train.cli import parse_args

GPT = dict(model="gpt", precision="float64")


def _train(**settings):
    return run(RunConfig(timeout=300, **settings))


@pytest.fixture(scope="module")
def uninterrupted():
    """One process, the whole batch, four steps: what every saved-and-resumed run must equal."""
    return train_single(RunConfig(**GPT, steps=4)).params


@pytest.mark.parametrize("impl,stage,saved_on,resumed_on", [
    *[("zeronb", s, a, b) for s in range(4) for a, b in ((4, 2), (2, 4))],
    *[("torch", s, 4, 2) for s in range(4)], ("torch", 3, 2, 4)])
def test_resumed_on_another_number_of_ranks_trains_on_as_one_uninterrupted_run(
        impl, stage, saved_on, resumed_on, uninterrupted, tmp_path):
    d = str(tmp_path / "ckpt")
    common = dict(GPT, stage=stage, impl=impl)
    first = _train(**common, nproc=saved_on, steps=2, checkpoint=d)
    info = checkpoint.read_info(d)
    assert (info["steps_done"], info["world_size"], info["stage"], info["impl"]) == (2, saved_on, stage, impl)
    resumed = _train(**common, nproc=resumed_on, steps=4, resume=d)
    assert [r.steps_taken for r in resumed.ranks] == [2] * resumed_on  # steps 3 and 4 only
    assert max_diff(resumed.params, uninterrupted) <= 1e-10
    # and two steps in, the checkpoint held the model (not the initial one: it trained)
    assert max_diff(checkpoint.export(d), first.params) == 0.0
    assert max_diff(first.params, uninterrupted) > 1e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_mixed_resumes_bit_for_bit_with_its_fp32_master_copy(stage, tmp_path):
    """In bf16-mixed the fp32 master copy is state too: without it, a resume would round every
    parameter to bf16 and drift; with it, a resume on the same ranks is the same run, bit for bit."""
    d = str(tmp_path / "ckpt")
    common = dict(model="gpt", precision="bf16-mixed", stage=stage, nproc=4)
    whole = _train(**common, steps=4).params
    _train(**common, steps=2, checkpoint=d)
    resumed = _train(**common, steps=4, resume=d).params
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(d).read_metadata().state_dict_metadata
    masters = [k for k in saved if k.endswith(".master")]
    assert masters and all(saved[k].properties.dtype == torch.float32 for k in masters), sorted(saved)


def test_each_rank_writes_its_own_shard_of_a_zero3_checkpoint(tmp_path):
    """ZeRO-3 on 4 ranks: four files of about a quarter of the state each, read from the disk."""
    d = tmp_path / "ckpt"
    rep = _train(**GPT, stage=3, nproc=4, steps=1, checkpoint=str(d))
    files = sorted(d.glob("*.distcp"))
    assert len(files) == 4, files
    sizes = [f.stat().st_size for f in files]
    state = 3 * rep.num_params * 8  # parameters and Adam's two moments, float64, the whole model
    for s in sizes:  # each file: one quarter of the state, plus DCP's framing
        assert 0.24 * state < s < 0.30 * state, (s, state)


def test_export_is_one_file_of_the_full_model(tmp_path):
    d, out = str(tmp_path / "ckpt"), str(tmp_path / "model.pt")
    saved = _train(**GPT, stage=3, impl="torch", nproc=2, steps=2, checkpoint=d).params
    from zeronb.checkpoint import main

    assert main([d, out]) == 0
    exported = torch.load(out)
    assert max_diff(exported, saved) == 0.0
    assert all(exported[k].shape == saved[k].shape for k in saved)


def test_a_resume_that_cannot_continue_the_run_says_why(tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    _train(stage=2, nproc=2, steps=2, checkpoint=d)
    cases = [(["--stage", "3", "--steps", "4", "--resume", d], "stage 3 (saved: 2)"),
             (["--stage", "2", "--impl", "torch", "--steps", "4", "--resume", d], "impl 'torch' (saved: 'zeronb')"),
             (["--stage", "2", "--steps", "2", "--resume", d], "has taken 2 steps already"),
             (["--stage", "2", "--steps", "4", "--resume", str(tmp_path / "none")], "holds no zeronb checkpoint")]
    for argv, message in cases:
        with pytest.raises(SystemExit):  # the command line: an argparse error
            parse_args(argv)
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match=r"stage 3 \(saved: 2\)"):  # Python: a ValueError, before anything starts
        RunConfig(stage=3, steps=4, resume=d)


def test_an_sgd_run_resumes_as_one_uninterrupted_run_and_refuses_an_adam_resume(tmp_path):
    d = str(tmp_path / "ckpt")
    common = dict(GPT, stage=2, optimizer="sgd")
    _train(**common, nproc=4, steps=2, checkpoint=d)
    resumed = _train(**common, nproc=2, steps=4, resume=d)
    assert max_diff(resumed.params, train_single(RunConfig(**GPT, optimizer="sgd", steps=4)).params) <= 1e-10
    with pytest.raises(ValueError, match="optimizer 'adam' \\(saved: 'sgd'\\)"):
        RunConfig(**GPT, stage=2, steps=4, resume=d)
