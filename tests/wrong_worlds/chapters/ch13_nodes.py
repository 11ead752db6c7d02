"""Chapter 13, nodes: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import averaging_over, replace, when_imported
from . import chapter, world
from .ch12_practice import _buckets_keep_what_they_sent


# --- chapter 13: nodes -------------------------------------------------------------------------------------------

chapter("13_nodes", {
    "places-and-links": "ranks node-major with torchrun's variables; the fitted links at the rates asked (10%); the "
                        "slow link's alpha negative",
    "rings-and-hierarchy": "the flat ring's crossing ranks send everything across; the hierarchy 2(k-1)/k S/g across; "
                           "times within 20% of the model, the hierarchy > 1.5x faster; misplaced groups 2x across",
    "ratios": "the refitted link at each ratio as asked; the hierarchy gains more as the link slows; its extra over "
              "the model above zero and the flat ring's; decided medians within 20% of the model",
    "stage-parity": "every exact variant equals one process; qwZ lossy but close",
    "stage-bytes": "bytes across within 5% of the ring formulas; the order claimed; MiCS's calls; DeepSpeed's hpZ",
    "stage-memory": "DDP, ZeRO-3, HSDP hold what they list (swept); HSDP 1/g, ZeRO-3 1/N; hpZ's secondary shards "
                    "exactly Psi b / g, gone after the step",
    "at-scale": "the model's order, latency small with one message per pass and not per unit, flat growth, 8 rings",
})


# --- places and links ------------------------------------------------------------------------------------------------

def _round_robin_launcher():
    def rank_environment(original):
        def round_robin(env, *, world_size, nodes, **kw):
            envs = original(env, world_size=world_size, nodes=nodes, **kw)
            for r, e in enumerate(envs):
                e.update(LOCAL_RANK=str(r // nodes), GROUP_RANK=str(r % nodes), NODE_RANK=str(r % nodes))
            return envs
        return round_robin
    replace("zeronb.pool.launch", "rank_environment", rank_environment)


world("13_nodes", "a launcher that places the ranks round-robin", "ranks are numbered node-major: here rank r is "
      "told it sits on node r % k", "places-and-links", _round_robin_launcher)


def _pacing_in_bits():
    def set_pacing(original):
        from zeronb.runtime.sockets import UNPACED
        return lambda fd, rate: original(fd, rate if rate >= UNPACED else min(8 * rate, UNPACED - 1))
    replace("zeronb.runtime.sockets", "set_pacing", set_pacing)


world("13_nodes", "pacing set in bits per second", "each link runs at the rate asked: here the pacing is set in bits "
      "per second, eight times the rate", "places-and-links", _pacing_in_bits)


def _latency_per_message():
    """Every message sent to another node waits 30 ms before it leaves (a network's latency, where
    pacing adds none)."""
    def patch(dist):
        import os
        import time

        send = dist.send

        def with_latency(tensor, dst=None, group=None, tag=0, **kw):
            g = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
            if g and dst is not None and dst // g != dist.get_rank() // g:
                time.sleep(0.03)
            return send(tensor, dst, group=group, tag=tag, **kw)
        dist.send = with_latency
    when_imported("torch.distributed", patch)


world("13_nodes", "a link with a latency per message", "the slow link's alpha is negative (its first segments leave "
      "unpaced, no latency): here every message across waits 30 ms", "places-and-links", _latency_per_message)


# --- the rings and the hierarchy ---------------------------------------------------------------------------------------

def _ring_ordered_by_local_rank():
    """The flat ring over all ranks visits them by local rank first (0, 2, 1, 3 on two nodes of two): every
    link of the ring crosses between the nodes. The sums stay right."""
    def patch(m):
        import os

        import torch.distributed as dist

        world_, peer_ = m.world, m.peer

        def order():
            n, g = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
            return sorted(range(n), key=lambda r: (r % g, r // g))

        def world(group=None):
            rank, n = world_(group)
            return (order().index(rank), n) if group is None else (rank, n)

        def peer(group, group_rank):
            return order()[group_rank] if group is None else peer_(group, group_rank)
        m.world, m.peer = world, peer
    when_imported("zeronb.collectives.ring", patch)


world("13_nodes", "a ring ordered by local rank", "a node-major ring crosses between the nodes twice: here it visits "
      "the ranks by local rank, and every link crosses", "rings-and-hierarchy", _ring_ordered_by_local_rank)


def _hierarchy_on_round_robin_groups():
    def node_groups(original):
        def round_robin():
            import torch.distributed as dist
            from zeronb.runtime.groups import per_world
            from zeronb.runtime.topology import Topology

            def make():
                n, k = dist.get_world_size(), Topology.from_env().nodes
                within = [dist.new_group(list(range(i, n, k))) for i in range(k)]
                across = [dist.new_group(list(range(j * k, (j + 1) * k))) for j in range(n // k)]
                return within[dist.get_rank() % k], across[dist.get_rank() // k]
            return per_world("round-robin node groups", make)
        return round_robin
    replace("zeronb.collectives.hierarchical", "node_groups", node_groups)


world("13_nodes", "a hierarchy on groups of another placement", "the hierarchical all-reduce keeps its big hops in the "
      "nodes: here its groups assume a round-robin placement", "rings-and-hierarchy", _hierarchy_on_round_robin_groups)


def _hierarchy_with_two_all_reduces():
    def hierarchical_all_reduce(original):
        def two_all_reduces(tensor, *, average=False, groups=None):
            """An all-reduce within the node, then one of the whole tensor across (no scatter)."""
            import torch.distributed as dist
            from zeronb.collectives.ring import ring_all_reduce
            from zeronb.runtime.groups import node_groups

            within, across = groups or node_groups()
            flat = tensor.detach().reshape(-1)
            ring_all_reduce(flat, group=within)
            ring_all_reduce(flat, group=across)
            if average:
                flat.div_(dist.get_world_size())
            tensor.copy_(flat.view_as(tensor))
            return tensor
        return two_all_reduces
    replace("zeronb.collectives.hierarchical", "hierarchical_all_reduce", hierarchical_all_reduce)


world("13_nodes", "a hierarchy whose hop across takes the whole tensor", "each rank sends only 2(k-1)/k S/g across: "
      "here the hop across all-reduces the node's whole sum", ("rings-and-hierarchy", "ratios"),
      _hierarchy_with_two_all_reduces)


def _node_one_at_half_rate():
    def set_pacing(original):
        import os

        from zeronb.runtime.sockets import UNPACED

        def half(fd, rate):
            return original(fd, rate // 2 if rate < UNPACED and os.environ.get("GROUP_RANK") == "1" else rate)
        return half
    replace("zeronb.runtime.sockets", "set_pacing", set_pacing)


world("13_nodes", "a node whose links run at half the rate", "the links run at the rates asked, and the model "
      "predicts the times: here node 1's ranks send at half the rate", "rings-and-hierarchy", _node_one_at_half_rate)


# --- the ratios ---------------------------------------------------------------------------------------------------------

def _re_pacing_only_new_connections():
    def patch(m):
        def set_rates(self, inter, intra):
            with self._lock:
                self.rates = {"inter": inter, "intra": intra}  # the connections to come; those open stay as they are
        m.Links.set_rates = set_rates
    when_imported("zeronb.runtime.links", patch)


world("13_nodes", "a re-pacing that leaves open connections as they were", "set_link_rates re-paces every link: "
      "here only connections opened later", "ratios", _re_pacing_only_new_connections)


def _model_prices_hops_within_at_the_slow_link():
    def hierarchical_all_reduce(original):
        def slow(nbytes, nodes, per_node, intra, inter):
            from zeronb.cost import ring_all_reduce
            return ring_all_reduce(nbytes, per_node, inter) + ring_all_reduce(nbytes / per_node, nodes, inter)
        return slow
    replace("zeronb.cost", "hierarchical_all_reduce", hierarchical_all_reduce)


world("13_nodes", "a model that prices the hops within a node at the slow link", "the model puts the hierarchy's hops "
      "within a node on the fast link and misses a fixed cost: here it prices them at the slow link", "ratios",
      _model_prices_hops_within_at_the_slow_link)


# --- the stages -------------------------------------------------------------------------------------------------------------

def _hsdp_divides_by_its_node():
    averaging_over("FlatStage", lambda stage: stage.num_shards)


world("13_nodes", "an HSDP that divides by its node's ranks only", "HSDP averages over every rank of every node: here "
      "it divides by the ranks it shards over", "stage-parity", _hsdp_divides_by_its_node)


def _qwz_quantizes_nothing():
    def patch(m):
        init = m.ZeROPlusPlus.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.quantize_weights = None
        m.ZeROPlusPlus.__init__ = __init__
    when_imported("zeronb.zero.zeropp", patch)


world("13_nodes", "a qwZ that quantizes nothing", "qwZ sends int8 blocks and costs accuracy: here its forward gathers "
      "the exact weights", ("stage-parity", "stage-bytes"), _qwz_quantizes_nothing)


def _hpz_backward_over_every_rank():
    def patch(m):
        issue = m.ZeROPlusPlus.issue_unshard

        def unshard_over_every_rank_in_backward(self, u):
            if self.in_backward:
                return m.ZeRO3.issue_unshard(self, u)
            return issue(self, u)
        m.ZeROPlusPlus.issue_unshard = unshard_over_every_rank_in_backward
    when_imported("zeronb.zero.zeropp", patch)


world("13_nodes", "an hpZ whose backward gathers over every rank", "hpZ's backward gathers within the node: here over "
      "every rank, across the slow link", "stage-bytes", _hpz_backward_over_every_rank)


def _deepspeed_hpz_without_node_size():
    replace("zeronb.zero.deepspeed_engine", "deepspeed_config",
            lambda original: lambda *args, **kwargs: original(*args, **{**kwargs, "hpz_ranks": None}))


world("13_nodes", "a DeepSpeed hpZ not told the node's size", "DeepSpeed's hpZ gathers its backward within the node: "
      "here its zero_hpz_partition_size is left unset", "stage-bytes", _deepspeed_hpz_without_node_size)


def _fsdp2_all_reduce_switch_ignored():
    def patch(m):
        m.FSDPModule.set_requires_all_reduce = lambda self, *args, **kwargs: None
    when_imported("torch.distributed.fsdp._fully_shard._fully_shard", patch)


world("13_nodes", "an FSDP2 whose set_requires_all_reduce does nothing", "MiCS all-reduces across nodes once per "
      "step: here FSDP2's replicas all-reduce after every micro-batch", "stage-bytes", _fsdp2_all_reduce_switch_ignored)


world("13_nodes", "buckets that keep what they sent, on nodes", "a stage holds what it lists: here every bucket keeps "
      "the last tensor it sent, unlisted", "stage-memory", _buckets_keep_what_they_sent)


def _shard_group_ignored():
    replace("zeronb.train.stages", "node_groups", lambda original: lambda: (None, None))


world("13_nodes", "an HSDP sharded over every rank", "HSDP shards within the node and holds 1/g: here the run ignores "
      "shard_group 'node' and shards over every rank", "stage-memory", _shard_group_ignored)


def _hpz_also_keeps_whole_units():
    def patch(m):
        after, step = m.ZeROPlusPlus.post_forward, m.ZeROPlusPlus.step

        def post_forward(self, u, out):
            if self.hpz:
                self.__dict__.setdefault("whole_units", {})[u.index] = u.data.detach().clone()
            after(self, u, out)

        def step_(self):
            step(self)
            self.__dict__.get("whole_units", {}).clear()
        m.ZeROPlusPlus.post_forward, m.ZeROPlusPlus.step = post_forward, step_
    when_imported("zeronb.zero.zeropp", patch)


world("13_nodes", "an hpZ that also keeps each whole unit", "hpZ's secondary shards cost Psi b / g during the step: "
      "here it also keeps a whole copy of every unit until the step", "stage-memory", _hpz_also_keeps_whole_units)


def _hpz_keeps_secondary_after_step():
    def patch(m):
        m.ZeROPlusPlus.step = lambda self: m.ZeRO3.step(self)
    when_imported("zeronb.zero.zeropp", patch)


world("13_nodes", "an hpZ that keeps its secondary shards after the step", "the step drops hpZ's secondary shards: "
      "here they stay", "stage-memory", _hpz_keeps_secondary_after_step)


# --- at scale --------------------------------------------------------------------------------------------------------------

def _zero3_priced_as_two_passes():
    def at_scale(original):
        def two(*args, **kwargs):
            out = original(*args, **kwargs)
            out["ZeRO-3"] = out["DDP"]
            return out
        return two
    replace("zeronb.cost", "at_scale", at_scale)


world("13_nodes", "a model that counts ZeRO-3's three passes as two", "ZeRO-3 costs 1.5x DDP: here the model prices "
      "it as DDP's all-reduce", "at-scale", _zero3_priced_as_two_passes)


def _hsdp_across_over_every_rank():
    def at_scale(original):
        def wide(nbytes, nodes, per_node, intra, inter):
            from zeronb.cost import ring_all_reduce
            out = original(nbytes, nodes, per_node, intra, inter)
            out["HSDP"] = 1.5 * ring_all_reduce(nbytes, per_node, intra) + \
                ring_all_reduce(nbytes / per_node, nodes * per_node, inter)
            return out
        return wide
    replace("zeronb.cost", "at_scale", at_scale)


world("13_nodes", "a model that runs HSDP's hop across over all ranks", "HSDP's replicas all-reduce over the k nodes: "
      "here the model runs that ring over all N ranks (N - 1 latencies)", "at-scale", _hsdp_across_over_every_rank)


def _ring_priced_as_all_gather():
    def ring_all_reduce(original):
        return lambda nbytes, n, link: 0.0 if n == 1 else (n - 1) * link.alpha + (n - 1) * nbytes * link.beta
    replace("zeronb.cost", "ring_all_reduce", ring_all_reduce)


world("13_nodes", "a ring all-reduce priced as an all-gather of whole tensors", "a ring's bytes per rank do not grow "
      "with N: here the model sends (N - 1) S from each rank", "at-scale", _ring_priced_as_all_gather)
