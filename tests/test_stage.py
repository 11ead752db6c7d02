"""What the Stage interface promises beyond parity: a step that fails lets its observers go; a
model trains under one stage at a time; ZeRO-3's units hold every parameter once; a stage refuses
the settings it cannot honour; and a run measures only the step it watches, so the steps it times
run with nothing watching. (That replicas reduce in reduce_dtype is in test_zero, with HSDP.)"""
import torch

from zeronb.models import Config, local_batch, make_model
from zeronb.train import RunConfig, run_many


# --- observers: a failing step releases what they hold open -------------------------------------------

def _failing_step_leaves_nothing_open():
    import torch.distributed as dist

    from zeronb import ledger
    from zeronb.zero.observe import PhaseTraffic, StepMemory
    from zeronb.zero import ZeRO2

    cfg = Config(kind="gpt")
    stage = ZeRO2(make_model(cfg, torch.float32), observers=[StepMemory(), PhaseTraffic()])
    watching = stage.observers[0]
    x, y = local_batch(cfg, 0, dist.get_rank(), dist.get_world_size())
    try:
        stage.train_step(x[:, :-1] * 0 + 10 ** 6, y)  # token ids past the vocabulary: the embedding raises
    except IndexError:
        pass
    else:
        raise AssertionError("the step was meant to fail")
    saved = dict(watching._saved)
    stage.model.loss(stage.model(x), y)  # another forward, after the failure: nobody counts it any more
    return ledger.recording(), saved == watching._saved


def test_a_step_that_raises_leaves_no_ledger_and_no_saved_tensor_hook_behind(gloo_pool):
    for recording, count_unchanged in gloo_pool(2).run(_failing_step_leaves_nothing_open, echo=False):
        assert not recording and count_unchanged


# --- one stage per model; ZeRO-3's units; settings a stage cannot honour --------------------------------

def _attach_twice():
    from zeronb.zero import DDP, ZeRO2, ZeRO3, NaiveDDP, StageConfig

    errors = {}
    model = make_model(Config(kind="gpt"), torch.float32)
    first = DDP(model)
    try:
        ZeRO2(model)
    except ValueError as e:
        errors["second stage"] = str(e)
    first.detach()
    ZeRO2(model)  # after detach, another stage may take it
    gpt = make_model(Config(kind="gpt"), torch.float32)
    for name, units in {"missing": gpt.units()[1:], "twice": [gpt.units()[0], gpt]}.items():
        try:
            ZeRO3(gpt, units=units)
        except ValueError as e:
            errors[name] = str(e)
    try:
        NaiveDDP(make_model(Config(), torch.float32), StageConfig(reduce_dtype=torch.bfloat16))
    except ValueError as e:
        errors["naive"] = str(e)
    return errors


def test_a_second_stage_bad_units_and_unsupported_settings_are_refused_with_what_to_do(gloo_pool):
    errors = gloo_pool(2).run(_attach_twice, echo=False)[0]
    assert "detach()" in errors["second stage"] and "make_model" in errors["second stage"]
    assert "in no unit" in errors["missing"] and "embed" in errors["missing"]
    assert "two units" in errors["twice"]
    assert "for reduce_dtype use DDP" in errors["naive"]


# --- only the observed step is measured --------------------------------------------------------------

def _watched_steps(model, stage_config):
    """ZeRO-2 noting, at each step, whether a ledger counted it and who was watching."""
    from zeronb import ledger
    from zeronb.zero import ZeRO2

    class Noting(ZeRO2):
        seen = []

        def train_step(self, x, y, micro_batches=1):
            Noting.seen.append((ledger.recording(), len(self.observers)))
            return super().train_step(x, y, micro_batches)

    Noting.seen = []
    stage = Noting(model, stage_config)
    _watched_steps.seen = Noting.seen
    return stage


def _seen():
    return _watched_steps.seen


def test_a_run_counts_and_watches_only_its_last_step(gloo_pool):
    pool = gloo_pool(2)
    (report,) = run_many([RunConfig(model="gpt", stage=2, steps=4)], pool, build=_watched_steps)
    assert report.ranks[0].sent_bytes_per_step["reduce_scatter"] > 0
    for seen in pool.run(_seen, echo=False):
        assert [recording for recording, _ in seen] == [False, False, False, True], seen
        assert [watchers for _, watchers in seen][:3] == [0, 0, 0] and seen[3][1] > 0, seen
