"""A training run, as data: what to run (`RunConfig`), and what each rank measured (`RankReport`)
and the run as a whole (`RunReport`). `python -m zeronb.train`'s flags parse into a RunConfig;
notebooks, tests, the exercises and the benchmarks build one with keywords:

    report = zeronb.train.run(RunConfig(stage=3, model="gpt", precision="float64", steps=5))
    report.ranks[0].sent_bytes_per_step, report.params
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import checkpoint
from ..models import MODELS, WRAPS, Config
from ..precision import OPTIMIZERS, PRECISIONS, precision
from ..runtime.topology import parse_rate
from ..zero import STAGES
from ..zero.config import REDUCE_SCATTERS, StageConfig
from ..zero.deepspeed_engine import check_runs_here, deepspeed_config
from ..zero.zeropp import QUANTIZE_WEIGHTS

REDUCE_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("zeronb", "torch", "deepspeed")  # zeronb's stages, PyTorch's counterparts, or DeepSpeed's ZeRO
SHARD_GROUPS = ("world", "node")  # shard over every rank, or within each node (replicas across: HSDP)
STRUCTURE = ("stage", "impl", "model", "precision", "optimizer")  # what a resume must share with the saved run


@dataclass
class RunConfig:
    stage: int = 0                  # 0 (DDP) .. 3
    nproc: Optional[int] = None     # ranks of a new pool (None: 2, or the size of the pool given to run)
    model: str = "mlp"              # "mlp" or "gpt" (zeronb.models)
    precision: str = "float32"      # "float32", "float64", "bf16-mixed" (zeronb.precision)
    optimizer: str = "adam"         # "adam" or "sgd"
    steps: int = 5
    seed: int = 0
    lr: float = 1e-3
    global_batch: int = 16
    impl: str = "zeronb"            # "zeronb", "torch" (PyTorch's DDP / ZeroRedundancyOptimizer / FSDP2) or "deepspeed"
    prefetch: bool = False          # stage 3: issue the next unit's all-gather before this unit computes
    reshard_after_forward: bool = True  # stage 3: free a unit's parameters after its forward
    wrap: str = "units"             # stage 3: the units gathered together (zeronb.models.choose_units)
    grad_accum: int = 1             # micro-batches per rank and step
    sync_each_micro_batch: bool = True  # with grad_accum: communicate gradients after every micro-batch (False: the last)
    clip_norm: Optional[float] = None   # clip the whole model's gradient to this 2-norm
    reduce_dtype: Optional[str] = None   # None (the gradients' own), "fp32" or "bf16"
    reduce_scatter: str = "torch"   # "torch" (the backend's) or "ring" (zeronb's)
    activation_checkpointing: bool = False
    shard_size: Optional[int] = None     # shard over groups of this many ranks, replicate across them (HSDP)
    shard_group: str = "world"      # "node": shard within each node, replicate across the nodes (HSDP, MiCS)
    nodes: Optional[int] = None     # a new pool's simulated nodes (1); on a pool given to run: the pool's
    inter_node_bandwidth: Optional[str] = None  # a new pool's link between nodes, paced ("50MB/s": zeronb.runtime.links)
    intra_node_bandwidth: Optional[str] = None  # and within a node (default: unpaced)
    hpz: bool = False               # stage 3: ZeRO++'s hpZ (zeronb), or FSDP2 resharding to a node after forward
    quantize_weights: Optional[str] = None      # stage 3, zeronb: "int8" forward all-gathers (ZeRO++'s qwZ)
    checkpoint: Optional[str] = None     # save a sharded checkpoint here at the end
    resume: Optional[str] = None         # load one saved there and train on to `steps` in all
    trace: bool = False             # the last step's timeline and memory trace, in the report
    timeout: float = 600            # seconds for the whole run on a pool
    deepspeed_overrides: Optional[dict] = None  # impl "deepspeed": its config keys laid over deepspeed_config()'s

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these settings, each saying what to do (empty: nothing)."""
        bad = []

        def choice(name, value, options):
            if value not in options:
                bad.append(f"{name} must be one of {', '.join(map(str, options))}, not {value!r}")

        choice("stage", self.stage, tuple(STAGES))
        choice("model", self.model, MODELS)
        choice("precision", self.precision, tuple(PRECISIONS))
        choice("optimizer", self.optimizer, OPTIMIZERS)
        choice("impl", self.impl, IMPLS)
        choice("wrap", self.wrap, WRAPS)
        choice("sync_each_micro_batch", self.sync_each_micro_batch, (True, False))
        choice("reduce_dtype", self.reduce_dtype, tuple(REDUCE_DTYPES))
        choice("reduce_scatter", self.reduce_scatter, REDUCE_SCATTERS)
        choice("shard_group", self.shard_group, SHARD_GROUPS)
        choice("quantize_weights", self.quantize_weights, QUANTIZE_WEIGHTS)
        bad += self._node_problems()
        if self.nproc is not None and (not isinstance(self.nproc, int) or self.nproc < 1):
            bad.append(f"nproc must be a positive number of ranks, not {self.nproc!r}")
        if self.steps < 1:
            bad.append("steps must be at least 1")
        if self.grad_accum < 1 or self.global_batch % self.grad_accum:
            bad.append(f"grad_accum must be a positive divisor of global_batch ({self.global_batch}), not {self.grad_accum}")
        if self.impl == "torch" and self.precision == "bf16-mixed":
            bad.append("impl 'torch' runs float32 or float64 (the comparison is about the algorithm, not precision)")
        if self.impl == "torch" and (self.prefetch or not self.reshard_after_forward or self.wrap != "units"
                                     or self.reduce_scatter != "torch"):
            bad.append("prefetch, reshard_after_forward, wrap and reduce_scatter choose among zeronb's own "
                       "stages; impl 'torch' picks PyTorch's by stage")
        if self.impl == "deepspeed":
            bad += self._deepspeed_problems()
        if self.stage != 3 and (self.prefetch or not self.reshard_after_forward or self.wrap != "units"):
            bad.append("prefetch, reshard_after_forward and wrap are stage 3's settings")
        if self.shard_size is not None and (self.shard_size < 1 or (self.nproc and self.nproc % self.shard_size)):
            bad.append(f"shard_size must divide the number of ranks ({self.nproc}), not {self.shard_size}")
        if (self.shard_size is not None or self.shard_group == "node") and (self.checkpoint or self.resume):
            bad.append("checkpoints of runs with replicas (shard_size, shard_group) are not supported; save from a "
                       "run sharded over all of its ranks")
        if not bad:  # the stage's own rules (clip_norm, ...), stated once, in StageConfig
            try:
                self.stage_config()
            except ValueError as e:
                bad.append(str(e))
        if self.resume is not None and not bad:
            bad += self._resume_problems()
        return bad

    def _node_problems(self) -> list[str]:
        bad = []
        if self.nodes is not None and (isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1
                                       or (self.nproc and self.nproc % self.nodes)):
            bad.append(f"nodes must be a positive number that divides the ranks ({self.nproc}), not {self.nodes!r}")
        for name in ("inter_node_bandwidth", "intra_node_bandwidth"):
            try:
                parse_rate(getattr(self, name))
            except ValueError as e:
                bad.append(f"{name}: {e}")
        if self.shard_group == "node" and self.shard_size is not None:
            bad.append("shard_group 'node' and shard_size both choose the shard groups: give one")
        if self.hpz and (self.shard_size is not None or self.shard_group == "node"):
            bad.append("hpz is ZeRO-3 over every rank with a second copy within the node; with replicas (shard_size, "
                       "shard_group) the node holds whole copies already: use one")
        if (self.hpz or self.quantize_weights) and self.stage != 3:
            bad.append("hpz and quantize_weights are stage 3's (ZeRO++ changes ZeRO-3's all-gathers)")
        if self.quantize_weights and self.impl == "torch":
            bad.append("quantize_weights is zeronb's (FSDP2 has no quantized all-gather); use impl 'zeronb'")
        return bad

    def _deepspeed_problems(self) -> list[str]:
        bad = []
        if self.stage == 0:
            bad.append("impl 'deepspeed' runs DeepSpeed's ZeRO stages 1, 2 and 3; for DDP use impl 'zeronb' or 'torch'")
        if self.precision == "float64":
            bad.append("DeepSpeed's optimizer steps a copy of its partitions in master_weights_and_grads_dtype, "
                       "float32 unless set (stage_1_and_2.py, stage3.py), so a float64 run would step in float32: "
                       "use float32 or bf16-mixed")
        if self.wrap != "units" or self.reduce_scatter != "torch" or self.quantize_weights:
            bad.append("wrap, reduce_scatter and quantize_weights choose among zeronb's own stages; DeepSpeed gathers "
                       "each module that owns parameters, reduces with the backend's collectives, and its qwZ "
                       "needs compiled CUDA kernels")
        if self.shard_size is not None or self.shard_group == "node":
            bad.append("replicas (shard_size, shard_group) are zeronb's and FSDP2's here; DeepSpeed's MiCS is not wired")
        if self.checkpoint or self.resume:
            bad.append("impl 'deepspeed' saves with DeepSpeed's own engine.save_checkpoint, not zeronb's checkpoints")
        if self.grad_accum > 1 and self.sync_each_micro_batch != (self.stage != 1):
            bad.append(f"DeepSpeed's stage {self.stage} communicates gradients "
                       + ("after the last micro-batch only: set sync_each_micro_batch=False" if self.stage == 1 else
                          "after every micro-batch: keep sync_each_micro_batch=True"))
        if not bad:
            try:
                check_runs_here(self.deepspeed_config(self.nproc or 2))
            except ValueError as e:
                bad.append(str(e))
        return bad

    def deepspeed_config(self, world_size: int) -> dict:
        """The DeepSpeed config of this run on `world_size` ranks (zeronb.zero.deepspeed_engine)."""
        return deepspeed_config(self.stage, world_size, self.global_batch, precision=self.precision,
                                micro_batches=self.grad_accum, clip_norm=self.clip_norm, reduce_dtype=self.reduce_dtype,
                                prefetch=self.prefetch, reshard_after_forward=self.reshard_after_forward,
                                hpz_ranks=(world_size // self.nodes) if self.hpz and self.nodes else None,
                                overrides=self.deepspeed_overrides)

    def _resume_problems(self) -> list[str]:
        try:
            info = checkpoint.read_info(self.resume)
            check_compatible(info, self.settings())
        except (FileNotFoundError, ValueError) as e:
            return [f"resume: {e}"]
        if info["steps_done"] >= self.steps:
            return [f"resume: the checkpoint has taken {info['steps_done']} steps already; steps counts the total, "
                    f"so ask for more than {info['steps_done']}"]
        return []

    def settings(self) -> dict:
        """What a checkpoint records of the run (a resume must share STRUCTURE)."""
        return {k: getattr(self, k) for k in ("stage", "impl", "model", "precision", "optimizer", "seed",
                                              "global_batch", "lr")}

    def model_config(self) -> Config:
        return Config(kind=self.model, seed=self.seed, global_batch=self.global_batch)

    def torch_dtype(self) -> torch.dtype:
        return precision(self.precision).dtype

    def stage_config(self, shard_group=None, replica_group=None) -> StageConfig:
        return StageConfig(precision=self.precision, optimizer=self.optimizer, lr=self.lr, clip_norm=self.clip_norm,
                           reduce_dtype=REDUCE_DTYPES[self.reduce_dtype],
                           sync_each_micro_batch=self.sync_each_micro_batch, reduce_scatter=self.reduce_scatter,
                           shard_group=shard_group, replica_group=replica_group)

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def check_compatible(info: dict, settings: dict) -> None:
    """Raise ValueError unless `settings` continue the run `info` describes."""
    saved = {"optimizer": "adam", **info}  # (checkpoints from before the choice of optimizer are Adam's)
    wrong = [f"{k} {settings[k]!r} (saved: {saved.get(k)!r})" for k in STRUCTURE if settings[k] != saved.get(k)]
    if wrong:
        raise ValueError("this checkpoint is of another kind of run: " + ", ".join(wrong) + "; resume with the "
                         "saved settings (the number of ranks may differ)")


@dataclass
class RankReport:
    """What one rank measured. Bytes held are between steps, after the last; bytes sent and calls
    are the last step's."""
    rank: int
    device: str
    num_params: int
    steps_taken: int                 # fewer than steps after a resume
    final_loss: float                # of the global batch (the ranks' local losses, averaged)
    step_ms: float                   # median of the unobserved steps after the first (warm-up); with fewer steps, what ran
    bytes: dict                      # {"params", "grads", "optimizer"}: storage the rank holds (zeronb.memory.measure
                                     # of the stage's own list of its tensors, state_tensors)
    expected_bytes: dict             # what zeronb.memory's formula says it should
    sent_bytes_per_step: dict        # logical bytes per collective (zeronb.ledger)
    calls_per_step: dict
    elements_per_step: Optional[dict] = None    # per collective: the elements its calls were handed (zeronb.ledger)
    wire_bytes_per_step: Optional[int] = None   # what the OS counted on gloo's connections (None: NCCL, not Linux)
    wire_within_node: Optional[int] = None      # on several nodes: those bytes, to ranks on this rank's node
    wire_across_nodes: Optional[int] = None     # and to ranks on other nodes
    grad_norm: Optional[float] = None           # the gradient norm before clipping (with clip)
    activation_bytes: Optional[int] = None      # saved by autograd in the last micro-batch's forward
    grad_bytes_after_micro_batch: Optional[list] = None  # gradients held after each micro-batch's backward
    cuda_allocated: Optional[int] = None        # on a GPU: torch.cuda's allocated bytes now, and the peak
    cuda_peak: Optional[int] = None
    grads: Optional[dict] = None     # {name: (start, stop, values)}: the averaged gradient the last step used
    timeline: Optional[list] = None  # with trace: (what, key, start, end) of the last step (zeronb.zero.observe)
    events: Optional[list] = None    # with trace: (event, key, seconds) of the last step
    timeline_origin: Optional[float] = None  # with trace, on the CPU: the clock reading those seconds count from
    memory_trace: Optional[list] = None  # with trace: (event, key, bytes held) at each event of the last step
    phases: Optional[dict] = None    # with trace: the last step's traffic by phase (zeronb.zero.observe.PhaseTraffic)
    params: Optional[dict] = None    # {name: full tensor} after training
    swept_bytes: Optional[int] = None  # every storage reachable from the stage, found from outside, not from its
                                       # own list (zeronb.memory.resident_bytes): what it really holds between steps

    @property
    def sent_bytes(self) -> int:
        """Bytes the last step sent, every collective together, as the ledger counted them (logical)."""
        return sum(self.sent_bytes_per_step.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state the rank holds between steps."""
        return sum(self.bytes.values())

    def to_json(self) -> dict:
        """Plain data: everything but the tensors."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("params", "grads")}


@dataclass
class RunReport:
    config: RunConfig
    world_size: int
    ranks: list = field(default_factory=list)   # RankReport per rank
    params: Optional[dict] = None               # {name: full tensor}, rank 0's

    @property
    def final_loss(self) -> float:
        return self.ranks[0].final_loss

    @property
    def num_params(self) -> int:
        return self.ranks[0].num_params

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.config), "world_size": self.world_size, "num_params": self.num_params,
                "final_loss": self.final_loss, "ranks": [r.to_json() for r in self.ranks]}
