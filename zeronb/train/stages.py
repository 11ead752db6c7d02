"""Which stage a run trains with: zeronb's own (DDP, ZeRO-1/2/3, ZeRO++) or PyTorch's counterpart,
built from the RunConfig on the process groups it asks for."""
from __future__ import annotations

import torch.distributed as dist

from ..models import choose_units
from ..runtime.groups import node_groups, sharding_groups
from ..zero import STAGES, ZeROPlusPlus
from ..zero.deepspeed_engine import DeepSpeedStage
from ..zero.torch_impls import torch_stage
from .runs import RunConfig


def build_stage(config: RunConfig, model, build=None):
    """The stage to train with, zeronb's own or PyTorch's counterpart, built from the run's settings
    (its process groups too: with shard_size, HSDP's). `build(model, stage_config)`: another
    stage class (a chapter's own, say) to train with instead of the one `config.stage` names."""
    groups = (node_groups() if config.shard_group == "node" else
              sharding_groups(config.shard_size) if config.shard_size else (None, None))
    stage_config = config.stage_config(*groups)
    if build is not None:
        return build(model, stage_config)
    if config.impl == "deepspeed":
        return DeepSpeedStage(model, config.stage, stage_config, config.deepspeed_config(dist.get_world_size()))
    if config.impl == "torch":
        return torch_stage(model, config.stage, stage_config, hpz=config.hpz)
    if config.stage != 3:
        return STAGES[config.stage](model, stage_config)
    zero3 = dict(prefetch=config.prefetch, reshard_after_forward=config.reshard_after_forward,
                 units=choose_units(model, config.wrap))  # ZeRO-3's own settings
    if config.hpz or config.quantize_weights:
        return ZeROPlusPlus(model, stage_config, hpz=config.hpz, quantize_weights=config.quantize_weights, **zero3)
    return STAGES[3](model, stage_config, **zero3)
