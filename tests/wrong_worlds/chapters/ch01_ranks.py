"""Chapter 1, ranks: its check cells and their wrong worlds."""
from __future__ import annotations

from ..planting import replace, when_imported
from . import chapter, world


# --- chapter 1: ranks ----------------------------------------------------------------------------------

chapter("01_ranks", {
    "ranks": "ranks 0..N-1, each once; me[r] is rank r's; RANK and WORLD_SIZE agree with torch.distributed",
    "numbering": "the pool's (RANK, LOCAL_RANK, GROUP_RANK, ...) are what two real torchrun agents give their "
                 "workers; every rank's MASTER_ADDR:MASTER_PORT is where the notebook's own process listens",
    "processes": "one process per rank, forked from one helper (not the notebook) that the restart reused; each "
                 "rank's connections to the others are the same before and after a call (the group is made once)",
    "backend": "auto chose gloo on the CPU here, and every rank's group and device say the same",
    "all-reduce": "every rank came out with N(N+1)/2; the %%ranks cells kept x, and a second all-reduce gave N times it",
    "failure": "rank 1 failed and stayed alive, the others were blocked in the barrier; the restarted pool's "
               "ranks are new processes without the old %%ranks state",
    "subgroups": "each subgroup renumbers its members from 0, -1 elsewhere; its all-reduce sums its members only",
    "torchrun": "under torchrun rank 0 got 'Connection closed by peer' at once, the agent stopped rank 2 with "
                "SIGTERM, torchrun named rank 1 as the root cause",
    "detail": "with TORCH_DISTRIBUTED_DEBUG=DETAIL both ranks raised at the call, naming both shapes",
})


# --- ranks, numbering, processes, backend ----------------------------------------------------------------

def _ranks_numbered_in_another_order():
    """The ranks join the group under numbers of its own (as a rendezvous that numbers them in the order
    they arrive): rank r of the group is the process that was given RANK r - 1."""
    def init_group(original):
        def shifted(backend, store, rank, world_size):
            return original(backend, store, (rank + 1) % world_size, world_size)
        return shifted
    replace("zeronb.pool._worker", "_init_group", init_group)


world("01_ranks", "a group that numbers the ranks in another order than RANK",
      "dist.get_rank() agrees with RANK: here the group numbers rank r as r + 1", "ranks",
      _ranks_numbered_in_another_order)


def _ranks_spread_round_robin():
    """The launcher spreads consecutive ranks over the nodes (SLURM's --distribution=cyclic): rank r on node
    r % nodes, local rank r // nodes."""
    def rank_environment(original):
        def cyclic(env, *, world_size, nodes, **kwargs):
            envs = original(env, world_size=world_size, nodes=nodes, **kwargs)
            for r, e in enumerate(envs):
                e.update(LOCAL_RANK=str(r // nodes), GROUP_RANK=str(r % nodes), NODE_RANK=str(r % nodes))
            return envs
        return cyclic
    replace("zeronb.pool.launch", "rank_environment", rank_environment)


world("01_ranks", "ranks spread over the nodes round-robin",
      "the numbering is torchrun's, node-major: here rank r is on node r % nodes (a cyclic distribution)",
      "numbering", _ranks_spread_round_robin)


def _store_in_a_process_of_its_own():
    """The rendezvous store runs in a process of its own (as an etcd server, or torchrun's agent, hosts it),
    not in the notebook: the ranks meet there, and the notebook is one more client."""
    def loopback_store(original):
        def elsewhere(world_size, timeout):
            import subprocess
            import sys

            import torch.distributed as dist
            host = ("import os, signal, time\n"
                    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                    "import torch.distributed as d\n"
                    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                    "print(s.port, flush=True)\n"
                    "parent = os.getppid()\n"
                    "while os.getppid() == parent:\n"
                    "    time.sleep(0.2)\n")  # (it ends with the notebook's kernel)
            server = subprocess.Popen([sys.executable, "-c", host], stdout=subprocess.PIPE, text=True)
            return dist.TCPStore("127.0.0.1", int(server.stdout.readline()), is_master=False, timeout=timeout)
        return elsewhere
    replace("zeronb.pool.launch", "loopback_store", loopback_store)


world("01_ranks", "a rendezvous store in a process of its own",
      "the rendezvous is a TCPStore hosted by the notebook: here it runs in a process of its own",
      "numbering", _store_in_a_process_of_its_own)


def _new_helper_every_start():
    """The helper is replaced at every start (its record of what it imported never matches), so a restart
    waits for a fresh import of torch, and its ranks have another parent."""
    def stamp(original):
        import itertools
        starts = itertools.count()
        return lambda env: (*original(env), next(starts))
    replace("zeronb.pool.forkserver", "_stamp", stamp)


world("01_ranks", "a helper replaced at every start",
      "the restarted pool was forked from the same helper: here every start has a new one", "processes",
      _new_helper_every_start)


def _group_reformed_every_call():
    """Every call runs in a process group of its own: after each call every rank leaves its group and
    joins a new one (as a launcher that runs each function like a torchrun script would)."""
    def patch(worker):
        to_cpu, calls = worker._to_cpu, [0]

        def reformed(value):
            import os
            from datetime import timedelta

            import torch.distributed as dist
            out = to_cpu(value)
            if dist.is_initialized():
                calls[0] += 1
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=timedelta(seconds=60))
                dist.destroy_process_group()
                worker._init_group(os.environ["ZERONB_BACKEND"], dist.PrefixStore(f"call{calls[0]}/", store),
                                   int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
            return out
        worker._to_cpu = reformed
    when_imported("zeronb.pool._worker", patch)


world("01_ranks", "a process group re-formed on every call",
      "each rank joins the group once and every call reuses it: here each call gets a new group",
      "processes", _group_reformed_every_call)


def _group_with_pytorchs_default_backend():
    """The ranks join with init_process_group's own default (backend=None): PyTorch picks a backend per
    device, and the group is not the gloo group the pool says it chose."""
    replace("zeronb.runtime.backend", "group_backend", lambda original: lambda backend: None)


world("01_ranks", "a group made with PyTorch's default backend",
      "inside a rank the backend is the one auto chose, gloo: here dist.get_backend() reads 'undefined'",
      "backend", _group_with_pytorchs_default_backend)


def _cpu_numbered_like_a_gpu():
    """zeronb.device() numbers the CPU by rank, as it numbers GPUs (cpu:r): tensors made there live on 'cpu'."""
    def rank_device(original):
        def numbered(backend, rank):
            import torch
            device = original(backend, rank)
            return torch.device("cpu", rank) if device.type == "cpu" else device
        return numbered
    replace("zeronb.runtime.backend", "rank_device", rank_device)


world("01_ranks", "a rank device numbered like a GPU (cpu:r)",
      "zeronb.device() is the device the rank's tensors live on: here it says cpu:r, and they are on cpu",
      "backend", _cpu_numbered_like_a_gpu)


# --- all-reduce, failure, subgroups --------------------------------------------------------------------

def _all_reduce_averages():
    """dist.all_reduce averages by default (as Horovod's allreduce does): op=SUM becomes AVG."""
    def patch(dist):
        original = dist.all_reduce

        def averaging(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return original(tensor, op=dist.ReduceOp.AVG if op == dist.ReduceOp.SUM else op, group=group,
                            async_op=async_op)
        dist.all_reduce = averaging
    when_imported("torch.distributed", patch)


world("01_ranks", "an all-reduce that averages by default",
      "all-reduce sums: every rank ends with N(N+1)/2; here it averages", "all-reduce", _all_reduce_averages)


def _cells_run_twice():
    """Each %%ranks cell runs twice on the ranks (once to find the value of its last line, say)."""
    def run_cell(original):
        def twice(source, filename, namespace):
            original(source, filename, namespace)
            return original(source, filename, namespace)
        return twice
    replace("zeronb.pool._worker", "_run_cell", run_cell)


world("01_ranks", "a %%ranks cell that runs twice",
      "the second %%ranks cell all-reduced x once more, N times the sum: here twice, N^2 times",
      "all-reduce", _cells_run_twice)


def _failed_rank_exits():
    """A rank that raised reports its error and then exits, as a torchrun worker's process does: its peers
    see their connections to it close."""
    def patch(connection):
        client = connection.Client

        def exits_after_an_error(*args, **kwargs):
            conn = client(*args, **kwargs)
            send = conn.send

            def send_then_exit(obj):
                send(obj)
                if getattr(obj, "status", None) == "error":
                    import os
                    os._exit(1)
            conn.send = send_then_exit
            return conn
        connection.Client = exits_after_an_error
    when_imported("multiprocessing.connection", patch)


world("01_ranks", "a failed rank that exits once it has reported",
      "the pool keeps a failed rank's process alive (no exit status): here it exits after reporting",
      "failure", _failed_rank_exits)


def _stacks_from_the_watch_thread():
    """The stack shown for a blocked rank is that of one of its other threads (the one that watches for its
    parent's death), not its main thread's."""
    def patch(errors):
        import re
        original = errors.format_stack_dump

        def wrong_thread(dump):
            threads = [t for t in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip()) if t.strip()]
            others = [t for t in threads if not errors.WORKER_LOOP_FRAME.search(t)]
            return original(others[0]) if others else original(dump)
        errors.format_stack_dump = wrong_thread
    when_imported("zeronb.pool.errors", patch)


world("01_ranks", "blocked ranks' stacks taken from the wrong thread",
      "each blocked rank's stack ends in dist.barrier(): here it is another thread's", "failure",
      _stacks_from_the_watch_thread)


def _state_restored_after_a_restart():
    """The ranks save their %%ranks variables after every cell and a restarted rank loads them again (a
    pool that checkpoints its ranks' state)."""
    import os
    if "ZERONB_WW_STATE" not in os.environ:  # the first process (the kernel): a folder for the saved state
        import atexit
        import shutil
        import tempfile
        os.environ["ZERONB_WW_STATE"] = tempfile.mkdtemp(prefix="zeronb-ww-state-")  # (the ranks inherit it)
        atexit.register(shutil.rmtree, os.environ["ZERONB_WW_STATE"], True)

    def run_cell(original):
        def checkpointed(source, filename, namespace):
            import os
            import types

            import cloudpickle
            path = os.path.join(os.environ["ZERONB_WW_STATE"], f"rank{os.environ['RANK']}.pkl")
            if "__restored__" not in namespace:
                namespace["__restored__"] = True
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        namespace.update(cloudpickle.load(f))
            try:
                return original(source, filename, namespace)
            finally:
                kept = {}
                for k, v in namespace.items():
                    if k.startswith("__") or isinstance(v, types.ModuleType):
                        continue
                    try:
                        kept[k] = cloudpickle.dumps(v) and v
                    except Exception:
                        pass
                with open(path, "wb") as f:
                    cloudpickle.dump(kept, f)
        return checkpointed
    replace("zeronb.pool._worker", "_run_cell", run_cell)


world("01_ranks", "a restart that restores the ranks' variables",
      "a restarted pool's ranks start without the old %%ranks state: here each rank reloads its variables",
      "failure", _state_restored_after_a_restart)


def _get_rank_is_global():
    """dist.get_rank(group) answers with the global rank (-1 outside the group): subgroups keep the global
    numbers."""
    def patch(dist):
        original = dist.get_rank

        def global_rank(group=None):
            rank = original()
            if group is None:
                return rank
            return rank if rank in dist.get_process_group_ranks(group) else -1
        dist.get_rank = global_rank
    when_imported("torch.distributed", patch)


world("01_ranks", "a get_rank(group) that answers with the global rank",
      "a subgroup numbers its members from 0: here every rank keeps its global number", "subgroups",
      _get_rank_is_global)


def _collectives_ignore_their_group():
    """A collective given group= runs over every rank of the job. (Planted for one-element tensors, the
    subgroups' sums: the chapter's later mismatch, 3 elements against 4 in a pair, would otherwise hang
    until the call's timeout.)"""
    def patch(dist):
        original = dist.all_reduce

        def everyone(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            return original(tensor, op=op, group=None if tensor.numel() == 1 else group, async_op=async_op)
        dist.all_reduce = everyone
    when_imported("torch.distributed", patch)


world("01_ranks", "collectives that ignore their group",
      "a subgroup's all-reduce sums its members only: here it sums every rank", "subgroups",
      _collectives_ignore_their_group)


# --- torchrun, TORCH_DISTRIBUTED_DEBUG ---------------------------------------------------------------

def _agent_kills_at_once():
    """torchrun's agent stops the other workers with SIGKILL (as a launcher that kills -9 does)."""
    def patch(api):
        import signal
        close = api.PContext.close

        def kill(self, death_sig=None, timeout=30):
            return close(self, signal.SIGKILL, timeout)
        api.PContext.close = kill
    when_imported("torch.distributed.elastic.multiprocessing.api", patch)


world("01_ranks", "a torchrun agent that stops workers with SIGKILL",
      "torchrun's agent stops the other workers with SIGTERM: here with SIGKILL", "torchrun", _agent_kills_at_once)


def _dead_peer_reported_as_a_timeout():
    """The backend reports a peer's closed connection as a timeout (as a backend that notices a dead peer
    only when its wait runs out)."""
    def patch(dist):
        original = dist.all_reduce

        def timing_out(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except RuntimeError as e:
                if "Connection closed by peer" not in str(e):
                    raise
                raise RuntimeError("[gloo] Timed out waiting for the peer's data") from None
        dist.all_reduce = timing_out
    when_imported("torch.distributed", patch)


world("01_ranks", "a dead peer reported as a timeout",
      "rank 0's all-reduce fails on the closed connection: here the backend reports a timeout", "torchrun",
      _dead_peer_reported_as_a_timeout)


def _root_cause_is_the_lowest_rank():
    """torchrun's summary names the lowest-numbered failed rank as the root cause (failures listed in rank
    order), not the first to fail. (Its record holds every rank it saw fail, the ones it stopped too.)"""
    def patch(errors):
        def lowest(self):
            rank = min(self.failures)
            return rank, self.failures[rank]
        errors.ChildFailedError.get_first_failure = lowest
    when_imported("torch.distributed.elastic.multiprocessing.errors", patch)


world("01_ranks", "a torchrun summary that names the lowest failed rank",
      "torchrun's root cause is the first failure, rank 1: here the lowest-numbered failed rank, 0", "torchrun",
      _root_cause_is_the_lowest_rank)


def _detail_names_no_shapes():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's error says that the collectives differ, not how (the fingerprints
    cut off, as a terser library would have it)."""
    def patch(dist):
        original = dist.all_reduce

        def terse(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except RuntimeError as e:
                if "CollectiveFingerPrint" not in str(e):
                    raise
                raise RuntimeError(str(e).split("CollectiveFingerPrint")[0] + "(fingerprints not shown)") from None
        dist.all_reduce = terse
    when_imported("torch.distributed", patch)


world("01_ranks", "a DETAIL check whose error names no shapes",
      "DETAIL's error names both ranks' shapes: here it only says that the collectives differ", "detail",
      _detail_names_no_shapes)
