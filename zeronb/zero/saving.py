"""What a flat stage (zeronb's DDP, ZeRO-1, -2, -3) saves and loads, and which piece of each
parameter its shards hold: the checkpoint (zeronb.checkpoint, with torch.distributed.checkpoint)
and the gradient watcher behind the parity checks (zeronb.zero.observe.Gradients) read a stage
through these, so that the stage's own modules keep only the step."""
from __future__ import annotations

from ..checkpoint import PARAMS, STEP, bucket_key, layout_entry
from ..runtime.compat import dtensor
from ..runtime.groups import device_mesh
from ..shards import shard_numel


class FlatSaving:
    """Mixed into FlatStage: its buckets (`self.buckets`) and the optimizer over their shards
    (`self.optimizer`) as a checkpoint and as pieces of the model's parameters.

    Rank r holds chunk r of each bucket (zeronb.shards: torch.chunk's rule); without its padding,
    that chunk is exactly what a DTensor with placement Shard(0) over a 1-D mesh of the ranks
    holds. So a checkpoint presents each bucket's parameters, Adam's two moments (plain SGD has
    none) and, in bf16-mixed, the fp32 master copy as 1-D DTensors of the bucket's real length;
    what every rank holds whole (DDP's buckets, Adam's step count) as plain tensors."""

    def shard_pieces(self, tensors):
        out = {}
        for bucket, t in zip(self.buckets, tensors):
            out.update(bucket.pieces(t.reshape(-1), self.names, self.shard_rank if self.sharded else None))
        return out

    def checkpoint_state(self):
        """The flat buckets' shards, as 1-D DTensors of the whole bucket (sharded) or the buckets
        themselves: the stage's own tensors (views of its shards and of the optimizer's state), so
        that torch.distributed.checkpoint loads straight into them."""
        if self.replica_group is not None:
            raise ValueError("a checkpoint of a stage with a replica group (HSDP) is not supported; save from a "
                             "run sharded over all of its ranks")
        opt = self.optimizer
        opt.init_state()  # (a no-op after the first step; before it, what loading writes into)
        DTensor, Shard, _ = dtensor()
        state = {}
        for i, (bucket, shard) in enumerate(zip(self.buckets, opt.shards)):
            per_element = {k: v for k, v in opt.state_of(i).items() if k != "step"}  # Adam's moments; SGD: none
            kinds = {PARAMS: shard, **per_element, **({"master": opt.master[i]} if opt.mixed else {})}
            for kind, t in kinds.items():
                if self.sharded:  # this rank's chunk, less its padding: torch.chunk's piece of the bucket
                    local = t[:shard_numel(bucket.numel, self.num_shards, self.shard_rank)]
                    state[bucket_key(bucket.name, kind)] = DTensor.from_local(
                        local, device_mesh(self.num_shards, group=self.shard_group), [Shard(0)], run_check=False,
                        shape=(bucket.numel,), stride=(1,))
                else:  # the whole bucket, the same on every rank
                    state[bucket_key(bucket.name, kind)] = t[:bucket.numel]
            if "step" in opt.state_of(i):
                state[STEP] = opt.state_of(i)["step"]  # every bucket's: the same count
        return state

    def load_checkpoint_state(self, state):
        if STEP in state:  # what loading could not write in place: into every shard's state
            for s in self.optimizer.states():
                s["step"].copy_(state[STEP])
        self.after_load()

    def after_load(self) -> None:
        """After a checkpoint was loaded into the shards: make the rest of the state agree with them."""

    def checkpoint_layout(self):
        return {b.name: [layout_entry(self.names[p], p.shape, o) for p, o in zip(b.params, b.offsets)] for b in self.buckets}
