"""zeronb.book.calculator: the numbers against hand-derived values, the errors, and the widget driven by hand."""
import matplotlib

matplotlib.use("Agg")  # no display: draw into memory

import pytest  # noqa: E402

from zeronb import memory  # noqa: E402
from zeronb.book.calculator import OPTIMIZERS, bytes_per_param, calculate, describe, memory_calculator, parse_num_params, plot


def test_paper_example_stage3():
    # the ZeRO paper: 7.5B parameters, N_d = 64, mixed-precision Adam -> 16 * psi / 64 bytes per device
    r = calculate(7.5e9, 64, 3, "bf16-mixed", "adam")
    assert r["total"] == 16 * 7.5e9 / 64 == 1.875e9
    assert r["bytes"] == {"params": 2 * 7.5e9 / 64, "grads": 2 * 7.5e9 / 64, "optimizer": 12 * 7.5e9 / 64}
    assert r["K"] == 12 and r["ddp_total"] == 120e9
    assert r["reduction"] == 64 and r["fraction_of_ddp"] == 1 / 64


@pytest.mark.parametrize("stage, expected", [(0, (2 + 2 + 12) * 1e9), (1, (2 + 2) * 1e9 + 12 * 1e9 / 8),
                                             (2, 2 * 1e9 + (2 + 12) * 1e9 / 8), (3, 16 * 1e9 / 8)])
def test_every_stage_mixed_adam(stage, expected):
    r = calculate("1B", 8, stage)
    assert r["total"] == pytest.approx(expected, rel=1e-15)
    assert r["total"] == memory.model_state_bytes(1e9, 8, stage)      # one place for the formulas
    assert r["stages"][stage] == r["bytes"]


@pytest.mark.parametrize("precision, optimizer, per", [
    ("bf16-mixed", "adam", (2, 2, 12)),          # master 4 + momentum 4 + variance 4
    ("float32", "adam", (4, 4, 8)),              # momentum + variance, no master copy
    ("float64", "adam", (8, 8, 16)),
    ("bf16-mixed", "sgd-momentum", (2, 2, 8)),   # master 4 + momentum 4
    ("float32", "sgd-momentum", (4, 4, 4)),      # momentum only
    ("float64", "sgd-momentum", (8, 8, 8)),
    ("bf16-mixed", "sgd", (2, 2, 4)),            # the master copy alone
    ("float32", "sgd", (4, 4, 0)),               # nothing to keep
])
def test_bytes_per_param(precision, optimizer, per):
    assert tuple(bytes_per_param(precision, optimizer).values()) == per


def test_sgd_cases_by_hand():
    # fp32 SGD with momentum, 125M parameters, 8 ranks, ZeRO-1: 4 + 4 bytes replicated, 4 / 8 sharded
    r = calculate("125M", 8, 1, "float32", "sgd-momentum")
    assert r["bytes"] == {"params": 500e6, "grads": 500e6, "optimizer": 4 * 125e6 / 8}
    assert r["total"] == 1062.5e6
    # mixed-precision plain SGD, ZeRO-2 on 4 ranks: 2 replicated; (2 + 4) / 4 sharded
    r = calculate(1e6, 4, 2, "bf16-mixed", "sgd")
    assert r["total"] == 2e6 + 6e6 / 4
    # fp32 plain SGD keeps no optimizer state: ZeRO-1 saves nothing
    r = calculate(1e6, 4, 1, "float32", "sgd")
    assert r["total"] == r["ddp_total"] == 8e6 and r["reduction"] == 1
    assert "the same as DDP" in describe(r)


def test_parse_num_params():
    assert parse_num_params("7.5B") == 7.5e9
    assert parse_num_params("125M") == 125e6
    assert parse_num_params("1T") == 1e12
    assert parse_num_params("350k") == 350e3
    assert parse_num_params(" 1e9 ") == 1e9
    assert parse_num_params("7,500,000") == 7.5e6
    assert parse_num_params(30016) == 30016.0


@pytest.mark.parametrize("args, words", [
    (("7.5Q", 64, 3), "number of parameters"),
    ((0, 64, 3), "positive"),
    ((-5e9, 64, 3), "number of parameters"),
    ((None, 64, 3), "number of parameters"),
    ((float("inf"), 64, 3), "finite"),
    ((7.5e9, 0, 3), "world_size"),
    ((7.5e9, 2.5, 3), "world_size"),
    ((7.5e9, True, 3), "world_size"),
    ((7.5e9, 64, 4), "stage must be a whole number 0..3"),
    ((7.5e9, 64, 3, "fp16"), "precision must be one of 'float32', 'float64', 'bf16-mixed'"),
    ((7.5e9, 64, 3, "float32", "adamw"), "optimizer must be one of 'adam', 'sgd-momentum', 'sgd'"),
])
def test_bad_input_says_what_is_wrong(args, words):
    with pytest.raises(ValueError, match=words):
        calculate(*args)


def test_describe_and_plot():
    r = calculate(7.5e9, 64, 3)
    line = describe(r)
    assert "1.88 GB per device" in line and "64x less" in line and "2 + 2 + 12 = 16" in line
    fig = plot(7.5e9, 64, 3)
    ax = fig.axes[0]
    assert ax.get_title() and ax.get_xlabel() and "GB" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["optimizer", "grads", "params"]
    assert len(ax.patches) >= 12  # 4 stages x 3 roles
    matplotlib.pyplot.close(fig)


def test_widget_builds_and_follows_its_controls():
    w = memory_calculator()
    assert set(w.controls) == {"num_params", "world_size", "stage", "precision", "optimizer"}
    assert set(OPTIMIZERS) == {v for _, v in w.controls["optimizer"].options}
    first_text, first_png = w.text.value, w.chart.value
    assert "ZeRO-3" in first_text and "1.88 GB" in first_text
    assert first_png[:8] == b"\x89PNG\r\n\x1a\n"

    w.controls["stage"].value = 1
    assert w.result["stage"] == 1 and "ZeRO-1" in w.text.value
    assert w.text.value != first_text and w.chart.value != first_png

    w.controls["world_size"].value = 8
    w.controls["precision"].value = "float32"
    w.controls["optimizer"].value = "sgd-momentum"
    w.controls["num_params"].value = "125M"
    assert w.result["total"] == calculate("125M", 8, 1, "float32", "sgd-momentum")["total"]
    assert "125M parameters on 8 ranks" in w.text.value

    good = w.result
    w.controls["num_params"].value = "lots"  # a typo: the message says so, the last result stays
    assert "number of parameters" in w.text.value and w.result is good
    w.controls["num_params"].value = "1T"
    assert w.result["num_params"] == 1e12
