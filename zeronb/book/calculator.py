"""A memory calculator: the bytes of model states one device holds, for any model size, number of
ranks, ZeRO stage, precision and optimizer.

    calculate(7.5e9, 64, 3, "bf16-mixed", "adam")["total"]   # 1.875e9 bytes per device
    memory_calculator()                                      # the same, as an ipywidgets explorer

The formulas are the ZeRO paper's and live in one place, `zeronb.memory.model_state_breakdown`.
All this module decides is how many bytes each parameter costs in each role, above all K, the
bytes of optimizer state per parameter, which depends on the optimizer as well as the precision:

    optimizer state per parameter = master copy (4 bytes fp32, in bf16-mixed only)
                                    + one tensor per state the optimizer keeps:
                                      Adam 2 (momentum, variance), SGD with momentum 1, plain SGD 0

(zeronb.precision, the one place for these facts): Adam's K is 12 in bf16-mixed, 8 in float32, 16
in float64; SGD with momentum 4 + 4 = 8 in bf16-mixed and 4 in float32; plain SGD 4 in bf16-mixed
and 0 otherwise.

The widget needs a live Jupyter kernel to respond; the rendered book shows zeronb.book.page's
calculator_html instead, whose script (calculator.js) answers in the page and is tested against
`calculate` and `describe` in a browser.
"""
from __future__ import annotations

import io
import math
import re

from .. import memory
from ..precision import OPTIMIZER_STATES, PRECISIONS

OPTIMIZERS = {"adam": "Adam", "sgd-momentum": "SGD with momentum", "sgd": "SGD"}  # name -> label
STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
ROLES = ("params", "grads", "optimizer")
MAX_WORLD_SIZE = 4096  # the widget's limit; calculate() takes any number of ranks
_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_num_params(value) -> float:
    """A parameter count from a number or a string such as "7.5B", "125M", "1T", "350k", "1e9"."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", value)
        if not m:
            raise ValueError(f"number of parameters: expected a number such as 7.5e9 or '7.5B' "
                             f"(suffixes K, M, B, T), not {value!r}")
        number = float(m.group(1).replace(",", "").replace("_", "")) * _SUFFIXES[m.group(2).upper()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"number of parameters must be a number or a string like '7.5B', not {value!r}")
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"number of parameters must be a positive, finite number, not {value!r}")
    return number


def bytes_per_param(precision: str, optimizer: str = "adam") -> dict:
    """{"params", "grads", "optimizer"}: bytes per parameter in each role, before any sharding.
    The "optimizer" entry is K."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZER_STATES))}, not {optimizer!r}")
    p, g, k = memory.bytes_per_parameter(precision, optimizer)
    return {"params": p, "grads": g, "optimizer": k}


def _check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be a whole number {bounds}, not {value!r}")


def calculate(num_params, world_size: int, stage: int, precision: str = "bf16-mixed",
              optimizer: str = "adam") -> dict:
    """Bytes of model states per device, by role, for one configuration (and for every stage).

    Returns a dict with the inputs (the optimizer by name), "bytes_per_param" ({"params", "grads",
    "optimizer"} before sharding) and "K" (its last entry), "bytes" (the same roles, per device),
    "total" (per device), "ddp_total" (stage 0's), "fraction_of_ddp", "reduction" (how many times
    less than DDP), and "stages": the per-device "bytes" of all four stages. Bad input raises
    ValueError saying what is expected."""
    psi = parse_num_params(num_params)
    _check_int("world_size (number of ranks)", world_size, 1)
    _check_int("stage", stage, 0, 3)
    per = bytes_per_param(precision, optimizer)
    kw = dict(param_bytes=per["params"], grad_bytes=per["grads"], optimizer_bytes=per["optimizer"])
    stages = {s: memory.model_state_breakdown(psi, world_size, s, **kw) for s in range(4)}
    mine = stages[stage]
    total, ddp_total = sum(mine.values()), sum(stages[0].values())
    return {"num_params": psi, "world_size": world_size, "stage": stage, "precision": precision,
            "optimizer": optimizer, "bytes_per_param": per, "K": per["optimizer"], "bytes": mine, "total": total,
            "ddp_total": ddp_total, "fraction_of_ddp": total / ddp_total if ddp_total else 1.0,
            "reduction": ddp_total / total if total else 1.0, "stages": stages}


# --- words and pictures ---------------------------------------------------------------------------

def format_count(n: float) -> str:
    """7.5e9 -> '7.5B', 1.25e8 -> '125M'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def unit_for(nbytes: float) -> tuple[str, float]:
    """The decimal unit (as the ZeRO paper uses: GB = 1e9 bytes) in which `nbytes` reads best."""
    for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return name, scale
    return "bytes", 1.0


def format_bytes(nbytes: float) -> str:
    name, scale = unit_for(nbytes)
    return f"{nbytes / scale:.3g} {name}"


def _times(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.3g}x"


def describe(result: dict) -> str:
    """One line: what one device holds in this configuration, and how that compares with DDP."""
    per, n = result["bytes_per_param"], result["world_size"]
    label = OPTIMIZERS[result["optimizer"]]
    parts = " + ".join(f"{r} {format_bytes(result['bytes'][r])}" for r in ROLES)
    if result["stage"] == 0:
        versus = "every rank holds all of it"
    elif n == 1:
        versus = "the same as DDP: with one rank there is nothing to share"
    elif result["total"] == result["ddp_total"]:
        versus = "the same as DDP: what this stage shards takes no memory here"
    else:
        versus = (f"{100 * result['fraction_of_ddp']:.3g}% of DDP's {format_bytes(result['ddp_total'])}, "
                  f"{_times(result['reduction'])} less")
    return (f"{STAGE_NAMES[result['stage']]}, {format_count(result['num_params'])} parameters on "
            f"{n} rank{'s' if n > 1 else ''}, {result['precision']} {label} "
            f"({per['params']:g} + {per['grads']:g} + {per['optimizer']:g} = {sum(per.values()):g} bytes per "
            f"parameter): "
            f"{format_bytes(result['total'])} per device ({parts}); {versus}")


COLORS = {"params": "C0", "grads": "C1", "optimizer": "C2"}


def draw(ax, result: dict) -> None:
    """Stacked bars of params / grads / optimizer per device for stages 0..3; the chosen stage
    is drawn solid and outlined, the others faded."""
    from matplotlib.patches import Patch

    unit, scale = unit_for(max(sum(b.values()) for b in result["stages"].values()))
    ax.axvspan(result["stage"] - 0.45, result["stage"] + 0.45, color="gold", alpha=0.25, lw=0)
    for s, parts in result["stages"].items():
        chosen = s == result["stage"]
        bottom = 0.0
        for role in ROLES:
            value = parts[role] / scale
            ax.bar(s, value, bottom=bottom, width=0.65, color=COLORS[role], alpha=1.0 if chosen else 0.4,
                   edgecolor="black" if chosen else "none", linewidth=1.2)
            bottom += value
        ax.text(s, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if chosen else "normal")
    ax.set_xlim(-0.55, 3.55)
    ax.set_xticks(range(4), [STAGE_NAMES[s] for s in range(4)], fontsize=8)
    ax.get_xticklabels()[result["stage"]].set_fontweight("bold")
    ax.set_xlabel("ZeRO stage (chosen one highlighted)")
    ax.set_ylabel(f"model states per device ({unit})")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room for the labels on top
    ax.set_title(f"{format_count(result['num_params'])} parameters, N = {result['world_size']} ranks, "
                 f"{result['precision']} {OPTIMIZERS[result['optimizer']]}", fontsize=10)
    handles = [Patch(color=COLORS[r], label=r) for r in reversed(ROLES)]  # top of the stack first
    ax.legend(handles=handles, title="role", fontsize=8, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))


def plot(num_params, world_size: int, stage: int, precision: str = "bf16-mixed", optimizer: str = "adam",
         figsize=(7, 3.8)):
    """The calculator's chart for one configuration, as a matplotlib figure (for a static page)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    draw(ax, calculate(num_params, world_size, stage, precision, optimizer))
    fig.tight_layout()
    return fig


def _png(result) -> bytes:
    # a Figure without pyplot: nothing is left open, and nothing is shown twice at the end of a cell
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.8), dpi=90)
    draw(fig.add_subplot(), result)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def memory_calculator(num_params="7.5B", world_size: int = 64, stage: int = 3, precision: str = "bf16-mixed",
                      optimizer: str = "adam"):
    """The calculator as a widget: inputs for the number of parameters, ranks, stage, precision and
    optimizer; a chart of all four stages and one line of text. Returns the widget (a VBox) with
    `.controls` (name -> input widget), `.text`, `.chart` (an Image) and `.result` (the last
    `calculate()` dict) attached."""
    import ipywidgets as widgets

    first = calculate(num_params, world_size, stage, precision, optimizer)  # bad defaults fail here, loudly
    style = {"description_width": "110px"}
    layout = widgets.Layout(width="320px")
    controls = {
        "num_params": widgets.Text(value=num_params if isinstance(num_params, str) else format_count(first["num_params"]),
                                   description="parameters", placeholder="7.5B, 125M, 1e12",
                                   continuous_update=False, style=style, layout=layout),
        "world_size": widgets.BoundedIntText(value=world_size, min=1, max=MAX_WORLD_SIZE, description="ranks N",
                                             style=style, layout=layout),
        "stage": widgets.ToggleButtons(options=[(STAGE_NAMES[s].split(" ")[0], s) for s in range(4)], value=stage,
                                       description="ZeRO stage", style={**style, "button_width": "70px"}),
        "precision": widgets.Dropdown(options=list(PRECISIONS), value=precision, description="precision",
                                      style=style, layout=layout),
        "optimizer": widgets.Dropdown(options=[(label, key) for key, label in OPTIMIZERS.items()],
                                      value=optimizer, description="optimizer", style=style, layout=layout),
    }
    text = widgets.HTML()
    chart = widgets.Image(format="png")
    box = widgets.VBox([widgets.HBox([widgets.VBox([controls[k] for k in ("num_params", "world_size", "precision",
                                                                           "optimizer")]),
                                      controls["stage"]]), text, chart])

    def update(_=None):
        try:
            result = calculate(*(controls[k].value for k in ("num_params", "world_size", "stage", "precision",
                                                              "optimizer")))
        except ValueError as e:  # e.g. "7.5Q" in the text box: say so, keep the last chart
            text.value = f"<span style='color:#b00'>{e}</span>"
            return
        box.result = result
        text.value = f"<b>{describe(result)}</b>"
        chart.value = _png(result)

    for w in controls.values():
        w.observe(update, names="value")
    box.controls, box.text, box.chart = controls, text, chart
    update()
    return box
