"""The minimal versions (zeronb.minimal) against the full engines, on real gloo ranks: the same
values after training (SGD, which shows a gradient scaled by a constant, and Adam), and the same
collectives - which ones, how many, how many elements - so that what a learner reads in the short
module is what the full engine does."""
import pytest
import torch
import torch.distributed as dist

STEPS = 3


def _ring(numel):
    from zeronb.collectives import ring_all_reduce
    from zeronb.ledger import CommLedger
    from zeronb.minimal import ring

    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    reference = x.clone()
    dist.all_reduce(reference)
    full = ring_all_reduce(x.clone())
    with CommLedger() as ledger:
        mine = ring.all_reduce(x.clone())
    chunk = x.clone()
    mine_rs = ring.reduce_scatter(chunk).clone()
    gathered = torch.zeros_like(x)
    gathered.view(n, -1)[rank] = reference.view(n, -1)[rank]
    ring.all_gather(gathered)
    return {"vs_torch": (mine - reference).abs().max().item(), "vs_full": (mine - full).abs().max().item(),
            "rs": (mine_rs - reference.view(n, -1)[rank]).abs().max().item(),
            "ag": (gathered - reference).abs().max().item(), "sent_to": dict(ledger.sent_to),
            "received_from": dict(ledger.received_from), "calls": dict(ledger.calls)}


@pytest.mark.parametrize("n", [2, 4])
def test_ring_by_hand_is_the_ring(gloo_pool, n):
    numel = 12 * 1024
    for rank, got in enumerate(gloo_pool(n).run(_ring, numel, echo=False, timeout=120)):
        assert got["vs_torch"] < 1e-12 and got["vs_full"] < 1e-12, got
        assert got["rs"] < 1e-12 and got["ag"] == 0.0, got
        # a ring: it sends only to the next rank and receives only from the previous one,
        # 2(N-1) chunks of N each way
        assert set(got["sent_to"]) == {(rank + 1) % n} and set(got["received_from"]) == {(rank - 1) % n}, got
        assert got["sent_to"][(rank + 1) % n] == 2 * (n - 1) * numel // n * 8


def _train(engine_name, optimizer, model_kind):
    """Train STEPS steps twice from the same model, with the full engine and with the minimal one;
    return both models' parameters and the collectives of each one's last step."""
    from zeronb import device
    from zeronb.ledger import CommLedger
    from zeronb.models import Config, local_batch, make_model
    from zeronb.zero import DDP, ZeRO1, ZeRO2, ZeRO3, StageConfig
    import importlib

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg, dtype = Config(kind=model_kind), torch.float64
    full_class = {"ddp": DDP, "zero1": ZeRO1, "zero2": ZeRO2, "zero3": ZeRO3}[engine_name]
    mini_class = getattr(importlib.import_module(f"zeronb.minimal.{engine_name}"), full_class.__name__)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
    out = {}

    model = make_model(cfg, dtype, device())
    stage = full_class(model, StageConfig(precision="float64", optimizer=optimizer, lr=0.05))
    for step in range(STEPS):
        x, y = local_batch(cfg, step, rank, n, dtype, device())
        with CommLedger() as full_ledger:
            stage.train_step(x, y)
    out["full"] = stage.full_parameters()
    stage.detach()

    model = make_model(cfg, dtype, device())
    engine = mini_class(model, lambda params: opt(params, lr=0.05, foreach=False))
    for step in range(STEPS):
        x, y = local_batch(cfg, step, rank, n, dtype, device())
        with CommLedger() as mini_ledger:
            model.loss(model(x), y).backward()
            engine.step()
    if engine_name == "zero3":  # gather the parameters to compare them
        for u in engine.units:
            u.unshard()
    out["mini"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    out["calls"] = (dict(full_ledger.calls), dict(mini_ledger.calls))
    out["elements"] = (dict(full_ledger.elements), dict(mini_ledger.elements))
    return out


ENGINES = ["ddp", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model_kind", ["mlp", "gpt"])
@pytest.mark.parametrize("engine", ENGINES)
def test_minimal_engine_is_the_full_engine(gloo_pool, engine, model_kind, optimizer):
    n = 4
    for got in gloo_pool(n).run(_train, engine, optimizer, model_kind, echo=False, timeout=180):
        diff = max((got["full"][k] - got["mini"][k]).abs().max().item() for k in got["full"])
        assert diff < 1e-12, f"{engine}: parameters differ by {diff}"
        full_calls, mini_calls = got["calls"]
        assert full_calls == mini_calls, f"{engine}: the full engine calls {full_calls}, the minimal one {mini_calls}"
        full_el, mini_el = got["elements"]
        if engine == "ddp":  # the full DDP pads its buckets to N chunks; the minimal one need not
            assert mini_el["all_reduce"] <= full_el["all_reduce"] < mini_el["all_reduce"] + n * full_calls["all_reduce"]
        else:
            assert full_el == mini_el, f"{engine}: elements {full_el} vs {mini_el}"


def _full_engines_driven_by_hand(engine_name):
    """The full engine driven as the minimal ones are (forward, backward, step) and through train_step:
    the same parameters; then a parameter that gets no gradient, and detach."""
    from zeronb import device
    from zeronb.models import Config, local_batch, make_model
    from zeronb.zero import DDP, ZeRO1, ZeRO2, ZeRO3, StageConfig

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg, dtype = Config(kind="gpt"), torch.float64
    cls = {"ddp": DDP, "zero1": ZeRO1, "zero2": ZeRO2, "zero3": ZeRO3}[engine_name]
    out = {}
    for how in ("train_step", "by hand"):
        stage = cls(make_model(cfg, dtype, device()), StageConfig(precision="float64", optimizer="sgd", lr=0.05))
        for step in range(STEPS):
            x, y = local_batch(cfg, step, rank, n, dtype, device())
            if how == "train_step":
                stage.train_step(x, y)
            else:
                stage.loss(x, y).backward()
                stage.step()
        out[how] = stage.full_parameters()
        stage.detach()
        model = stage.model  # detached: a whole model again, that runs on its own
        out[f"{how}, after detach"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        model(local_batch(cfg, 0, rank, n, dtype, device())[0])
    model = make_model(cfg, dtype, device())
    model.unused = torch.nn.Linear(3, 3, dtype=dtype, device=device())  # in a bucket, never in forward
    stage = cls(model, StageConfig(precision="float64"), **({"units": model.units() + [model.unused]}
                                                             if engine_name == "zero3" else {}))
    try:
        stage.train_step(*local_batch(cfg, 0, rank, n, dtype, device()))
        out["unused"] = None
    except RuntimeError as e:
        out["unused"] = str(e)
    stage.detach()
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_the_full_engine_driven_by_hand_trains_as_through_train_step(gloo_pool, engine):
    for got in gloo_pool(4).run(_full_engines_driven_by_hand, engine, echo=False, timeout=180):
        for k in got["train_step"]:
            assert torch.equal(got["train_step"][k], got["by hand"][k]), k
            assert torch.equal(got["train_step"][k], got["train_step, after detach"][k]), k
        if engine == "zero1":  # no gradient hooks: the unused parameter's gradient is zeros, harmlessly
            assert got["unused"] is None, got["unused"]
        else:
            assert got["unused"] and "unused.weight" in got["unused"] and "got no gradient" in got["unused"], got["unused"]
