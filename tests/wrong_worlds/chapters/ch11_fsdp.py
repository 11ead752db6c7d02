"""Chapter 11, FSDP: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace
from . import chapter, world
from .ch10_zero3 import (_fsdp2_keeps_its_last_unit, _frees_by_zeroing, _gathers_last_unit_twice,
                         _gathers_move_nothing_until_waited, _keeps_a_copy_of_freed_units, _prefetch_always,
                         _real_reduce_scatter_on_gloo, _sums_gradients)


# --- chapter 11: FSDP ------------------------------------------------------------------------------------

chapter("11_fsdp", {
    "units": "the units cover the model and divide by N, as every first dimension does; 1 unit whole, 16 per layer",
    "parity": "every run (zeronb's ZeRO-3 variants and wrappings, FSDP2) = one process, its gradients, SGD; prefetch bit for bit",
    "bytes": "3(N-1)/N Ψb less the last unit's gather, 2(N-1)/N for keep; 3U-1 and 2U calls; FSDP2's calls",
    "peaks": "peak full parameters per setting and wrapping; between steps only shards, swept = listed",
    "prefetch": "issued early only with prefetch; some gathers complete before the wait (completion query); the stage "
                "waits for every gather without; bars in the watched step; watching slows it",
    "wire": "on gloo's wire each reduce-scatter costs an all-reduce; FSDP2 keeping its last unit = zeronb, by default "
            "one all-gather more",
    "deepspeed-prefetch": "DeepSpeed gathers twice without prefetch, once with prefetch or keep; same reduce-scatters",
    "knob-map": "DeepSpeed's own config classes read every key of the knob map as the table says",
})


def _whole_ignored():
    def choose_units(original):
        return lambda model, wrap="units": original(model, "units" if wrap == "whole" else wrap)
    replace("zeronb.models", "choose_units", choose_units)


world("11_fsdp", "wrap='whole' gives the model's own units", "wrap='whole' makes the whole model one unit: here it "
      "gives the model's units", "units", _whole_ignored)
world("11_fsdp", "ZeRO-3 sums its gradients (chapter 11)", "every run trains as one process does: here ZeRO-3 sums "
      "the ranks' gradients where it should average them", "parity", _sums_gradients)
world("11_fsdp", "ZeRO-3 gathers its last unit twice (chapter 11)", "3U - 1 collectives and 3(N-1)/N Ψb less the "
      "last unit's gather: here the last unit is freed after forward and gathered again", "bytes",
      _gathers_last_unit_twice)
world("11_fsdp", "ZeRO-3 keeps a copy of every unit it frees (chapter 11)", "between steps only shards: here each unit "
      "keeps a copy of the full parameters it last released", "peaks", _keeps_a_copy_of_freed_units)
world("11_fsdp", "ZeRO-3 frees a unit by zeroing it (chapter 11)", "the peak is the largest unit: here free() zeroes "
      "the full parameters and keeps their storage", "peaks", _frees_by_zeroing)
world("11_fsdp", "ZeRO-3's gathers move nothing until they are waited for (chapter 11)", "with prefetch some gathers "
      "complete before they are needed: here a gather transfers nothing until the stage waits for it", "prefetch",
      _gathers_move_nothing_until_waited)
world("11_fsdp", "ZeRO-3 prefetches when not asked to (chapter 11)", "without prefetch nothing is issued early and "
      "the stage waits for every gather: here ZeRO-3 always prefetches", "prefetch", _prefetch_always(True))
world("11_fsdp", "gloo with a real reduce-scatter (chapter 11)", "gloo runs a reduce-scatter as an all-reduce: here it "
      "sends what a ring reduce-scatter sends", "wire", _real_reduce_scatter_on_gloo)
world("11_fsdp", "FSDP2 keeps its last unit by default (chapter 11)", "by default FSDP2 gathers the head twice, one "
      "all-gather more than zeronb on the wire: here TorchFSDP keeps its last unit", ("wire", "bytes"),
      _fsdp2_keeps_its_last_unit)


def _prefetch_budget_left_out():
    def deepspeed_config(original):
        def without_budget(*args, **kwargs):
            config = original(*args, **kwargs)
            config["zero_optimization"].pop("stage3_prefetch_bucket_size", None)
            return config
        return without_budget
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config", deepspeed_config)


world("11_fsdp", "DeepSpeed's prefetch budget left at its default", "without prefetch DeepSpeed gathers every "
      "parameter twice: here zeronb's config leaves stage3_prefetch_bucket_size out, and DeepSpeed's default "
      "prefetches", "deepspeed-prefetch", _prefetch_budget_left_out)


def _key_under_another_name():
    def deepspeed_config(original):
        def renamed(*args, **kwargs):
            config = original(*args, **kwargs)
            if "gradient_clipping" in config:
                config["clip_gradients"] = config.pop("gradient_clipping")
            return config
        return renamed
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config", deepspeed_config)


world("11_fsdp", "a DeepSpeed key under a name DeepSpeed does not read", "DeepSpeed reads every key of the knob map: "
      "here the clipping norm is written as clip_gradients, which DeepSpeed ignores (its own default stays)", "knob-map",
      _key_under_another_name)
