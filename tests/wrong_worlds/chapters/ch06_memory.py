"""Chapter 6, memory: its check cells and their wrong worlds (and two faults of the backend that chapter 12
plants too: bf16 reduced in fp32, bf16 sent as fp32 below the ledger)."""
from __future__ import annotations

from ..planting import reduce_scatter, replace, when_imported
from . import chapter, world


# --- chapter 6: memory -----------------------------------------------------------------------------------

chapter("06_memory", {
    "ddp-states": "DDP holds exactly what it lists (swept from outside); each role is its bytes per parameter on "
                  "the padded layout, K = master + momentum + variance in bf16-mixed: 16 bytes per parameter",
    "rules-of-thumb": "SGD with momentum holds what the calculator says (12 B/param); mixed Adam's optimizer (12) "
                      "is outside the note's 6-8; no setting has 6",
    "activations": "activations exactly linear in the batch, superlinear in the sequence, not following psi, the "
                   "same at every stage and rank for 1/N of the batch",
    "mixed-wire": "bf16 credited half of float32; on the wire, the credit (twice for gloo's reduce-scatter) plus "
                  "gloo's measured framing per call, within 1%",
    "table-1": "the paper's Table 1, as printed, from zeronb.memory's formulas; its examples",
    "shares": "a stage's share of DDP's memory is psi-independent, near the note's numbers only at N = 2..3 "
              "(float32), 1/N for ZeRO-3, with limits 25% and 12.5%",
    "zero2-and-factors": "ZeRO-2 holds 2 + 14/N with a bf16 gradient shard, 2 + 16/N with an fp32 one (swept); "
                         "reduction factors: ZeRO-3 N_d, ZeRO-1 < 4, ZeRO-2 < 8",
    "stages-measured": "every stage holds exactly what it lists (swept), within 3% of the breakdown by role, exactly "
                       "it on the padded layout plus step counters",
    "calculator": "the calculator's paper example and SGD case, a bad size refused, the widget following its controls",
    "deepspeed-estimators": "DeepSpeed's estimators = zeronb's calculator + the named terms, to the byte; their CPU "
                            "terms; TinyGPT's largest layer",
})


# --- the optimizer and the stages --------------------------------------------------------------------------

def _fp32_gradient_copy_kept():
    """Mixed-precision Adam keeps the fp32 copy of the gradients it steps with, from one step to the next
    (a cache of the upcast gradients, as DeepSpeed's fp32 gradient partition is): 4 more bytes per
    parameter it updates, which the stage's own list does not name."""
    def patch(m):
        step = m.ShardOptimizer.step

        def keeping(self, grads):
            self.fp32_grads = [g.float() for g in grads] if self.mixed else None
            step(self, grads)
        m.ShardOptimizer.step = keeping
    when_imported("zeronb.zero.optim", patch)


world("06_memory", "mixed Adam keeps an fp32 copy of its gradients", "a stage holds what it lists: here mixed "
      "Adam keeps the fp32 gradients it stepped with, unlisted", ("ddp-states", "stages-measured"),
      _fp32_gradient_copy_kept)


def _master_copy_in_bf16():
    """bf16-mixed with a master copy kept in the parameters' dtype (bf16), and so Adam's moments in bf16 too:
    6 bytes of optimizer state per parameter, not 12."""
    def patch(m):
        import torch

        init, step = m.ShardOptimizer.__init__, m.ShardOptimizer.step

        def __init__(self, shards, config, sharded=True, group=None):
            init(self, shards, config, sharded, group)
            if self.mixed:
                self.master = [s.detach().clone() for s in shards]  # bf16, as the parameters
                self.optimizer = m.optimizer_class(config.optimizer)(self.master, lr=config.lr, foreach=False)

        def step_(self, grads):
            if self.mixed:
                grads = [g.to(self.master[0].dtype) for g in grads]
                for master, grad in zip(self.master, grads):
                    master.grad = grad
                self.optimizer.step()
                for master in self.master:
                    master.grad = None
                with torch.no_grad():
                    for shard, master in zip(self.shards, self.master):
                        shard.copy_(master)
                return
            step(self, grads)
        m.ShardOptimizer.__init__, m.ShardOptimizer.step = __init__, step_
    when_imported("zeronb.zero.optim", patch)


world("06_memory", "the master copy kept in bf16", "mixed-precision Adam keeps K = 12 bytes (fp32 master, "
      "momentum, variance): here the master copy, and so the moments, are bf16", ("ddp-states", "rules-of-thumb"),
      _master_copy_in_bf16)


def _zero2_gradient_shard_always_fp32():
    def patch(m):
        import torch

        init = m.ZeRO2.__init__

        def __init__(self, model, config=None, observers=(), bucket_bytes=64 << 10, grad_shard_dtype=None):
            init(self, model, config, observers, bucket_bytes, torch.float32)
        m.ZeRO2.__init__ = __init__
    when_imported("zeronb.zero.zero2", patch)


world("06_memory", "ZeRO-2 keeps its gradient shard in fp32", "the paper's ZeRO-2 holds 2 + 14/N: here its reduced "
      "gradient shard is always kept in fp32, whatever it is asked (the note's 2 + 16/N)",
      ("zero2-and-factors", "stages-measured"), _zero2_gradient_shard_always_fp32)


def _zero3_keeps_last_unit_gathered():
    """ZeRO-3 does not free a unit after its backward when it is the last unit (whose forward kept it
    gathered already): its full parameters stay from one step to the next."""
    def patch(m):
        post_backward = m.ZeRO3.post_backward

        def post_backward_keeping_the_last(self, u):
            if u.index == len(self.units) - 1 and self.model.training:
                if self.sync_now():
                    reduce_scatter(self, u)
                return  # (not resharded: it stays gathered into the next step)
            post_backward(self, u)
        m.ZeRO3.post_backward = post_backward_keeping_the_last
    when_imported("zeronb.zero.zero3", patch)


world("06_memory", "ZeRO-3 keeps its last unit gathered between steps", "between steps ZeRO-3 holds 1/N of the "
      "parameters: here the last unit's full parameters stay", "stages-measured", _zero3_keeps_last_unit_gathered)


# --- activations ---------------------------------------------------------------------------------------------

def _attention_across_the_batch():
    """Attention over the batch flattened into one sequence (a reshape that forgets the batch dimension):
    every token attends to every earlier token of every earlier sequence, scores (B*T)^2 per head."""
    def patch(m):
        forward = m.Block.forward

        def flattened(self, x):
            b, t, d = x.shape
            return forward(self, x.reshape(1, b * t, d)).reshape(b, t, d)
        m.Block.forward = flattened
    when_imported("zeronb.models", patch)


world("06_memory", "attention across the whole batch", "activations grow linearly with the batch: here attention "
      "runs over the batch flattened into one sequence", "activations", _attention_across_the_batch)


def _memory_efficient_attention():
    """torch's scaled_dot_product_attention (a fused kernel that saves no T x T scores for backward)."""
    def patch(m):
        import torch.nn.functional as F

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))
        m.Block.forward = forward
    when_imported("zeronb.models", patch)


world("06_memory", "memory-efficient attention", "activations grow faster than the sequence (T x T scores per "
      "head): here a fused attention kernel saves none", "activations", _memory_efficient_attention)


def _weights_copied_for_each_matmul():
    """Every Linear computes with a copy of its weight (as torch.autocast casts each weight), which autograd
    keeps for backward: saved bytes that grow with the parameters."""
    def patch(nn):
        import torch.nn.functional as F

        nn.Linear.forward = lambda self, x: F.linear(x, self.weight.clone(), self.bias)
    when_imported("torch.nn", patch)


world("06_memory", "a copy of each weight saved for backward", "activations do not follow psi: here every linear "
      "layer computes with a copy of its weight, which autograd keeps", "activations", _weights_copied_for_each_matmul)


def _zero3_checkpoints_its_units():
    def patch(m):
        from zeronb.models import checkpoint_activations

        init = m.ZeRO3.__init__

        def __init__(self, model, *args, **kwargs):
            checkpoint_activations(model)
            init(self, model, *args, **kwargs)
        m.ZeRO3.__init__ = __init__
    when_imported("zeronb.zero.zero3", patch)


world("06_memory", "ZeRO-3 that checkpoints its units", "ZeRO leaves the activations as they are at every stage: "
      "here zeronb's ZeRO-3 turns on activation checkpointing for its units", "activations",
      _zero3_checkpoints_its_units)


def _every_rank_takes_the_whole_batch():
    def patch(m):
        m.local_batch = lambda cfg, step, rank, world_size, dtype=None, device="cpu": m.global_batch(
            cfg, step, *(() if dtype is None else (dtype,)), device)
    when_imported("zeronb.models", patch)


world("06_memory", "every rank takes the whole batch", "each rank processes its 1/N of the global batch: here every "
      "rank takes all of it (no sampler)", "activations", _every_rank_takes_the_whole_batch)


# --- what mixed precision sends --------------------------------------------------------------------------------

def _mixed_reduces_in_fp32():
    """bf16-mixed communicates its gradients in fp32 unless told otherwise (as FSDP's MixedPrecision with
    reduce_dtype=float32 does)."""
    def patch(m):
        import torch

        post_init = m.StageConfig.__post_init__

        def __post_init__(self):
            post_init(self)
            if self.precision == "bf16-mixed" and self.reduce_dtype is None:
                self.reduce_dtype = torch.float32
        m.StageConfig.__post_init__ = __post_init__
    when_imported("zeronb.zero.config", patch)


world("06_memory", "mixed precision reduces gradients in fp32", "bf16-mixed sends bf16 gradients: here they are "
      "reduced in fp32", "mixed-wire", _mixed_reduces_in_fp32)


def _below_every_ledger(make_mode):
    """Run a TorchDispatchMode just below every CommLedger (entered first, left last): the ledger sees and
    credits each call as the caller made it; the mode changes what the backend then does."""
    def patch(m):
        enter, exit_ = m.CommLedger.__enter__, m.CommLedger.__exit__

        def __enter__(self):
            self._wrong_world_mode = make_mode()
            self._wrong_world_mode.__enter__()
            return enter(self)

        def __exit__(self, *exc):
            try:
                return exit_(self, *exc)
            finally:
                self._wrong_world_mode.__exit__(*exc)
        m.CommLedger.__enter__, m.CommLedger.__exit__ = __enter__, __exit__
    when_imported("zeronb.ledger", patch)


def _bf16_as_fp32_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    upcast = {"allreduce_", "_allgather_base_", "_reduce_scatter_base_"}

    class Fp32OnTheWire(TorchDispatchMode):
        """A backend without bf16 arithmetic: bf16 collectives travel and sum as fp32, cast back on arrival."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            namespace, _, op = func._schema.name.partition("::")
            if namespace != "c10d" or op not in upcast:
                return func(*args, **kwargs)
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            if first.dtype != torch.bfloat16:
                return func(*args, **kwargs)
            wide = lambda t: [x.float() for x in t] if isinstance(t, (list, tuple)) else t.float()  # noqa: E731
            out = func(wide(args[0]), wide(args[1]) if op != "allreduce_" else args[1], *args[2:], **kwargs)
            work = out[1]
            torch._C._distributed_c10d.Work.unbox(work).wait()
            got = out[0]
            if isinstance(args[0], (list, tuple)):
                for t, w in zip(args[0], got):
                    t.copy_(w)
            else:
                args[0].copy_(got)
            return (args[0], work)
    return Fp32OnTheWire()


world("06_memory", "a backend that sends bf16 as fp32", "bf16 halves the bytes on the wire: here the backend "
      "carries and sums bf16 collectives as fp32 (the ledger still credits bf16)", "mixed-wire",
      lambda: _below_every_ledger(_bf16_as_fp32_mode))


def _real_reduce_scatter_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class RealReduceScatter(TorchDispatchMode):
        """gloo's reduce-scatter as a real one (NCCL's kind): each rank sends each other rank only its chunk
        (an all-to-all), and adds what it receives."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._schema.name != "c10d::_reduce_scatter_base_":
                return func(*args, **kwargs)
            out, inp, group = args[0], args[1], args[2]
            n = inp.numel() // out.numel()
            received = torch.empty_like(inp)
            work = torch.ops.c10d.alltoall_base_(received, inp.contiguous(), group, [], [], True, -1)
            torch._C._distributed_c10d.Work.unbox(work).wait()
            out.copy_(received.view(n, -1).sum(0).view_as(out))
            return (out, work)
    return RealReduceScatter()


world("06_memory", "gloo with a real reduce-scatter", "gloo runs a reduce-scatter as an all-reduce (twice its "
      "credit on the wire): here it sends each rank only its chunk", "mixed-wire",
      lambda: _below_every_ledger(_real_reduce_scatter_mode))


# --- the formulas ------------------------------------------------------------------------------------------------

def _zero2_formula_keeps_gradients_whole():
    def model_state_bytes(original):
        def wrong(num_params, world_size, stage, param_bytes=2, grad_bytes=2, optimizer_bytes=12):
            if stage == 2:  # the stage-1 formula: gradients whole
                return original(num_params, world_size, 1, param_bytes, grad_bytes, optimizer_bytes)
            return original(num_params, world_size, stage, param_bytes, grad_bytes, optimizer_bytes)
        return wrong
    replace("zeronb.memory", "model_state_bytes", model_state_bytes)


world("06_memory", "a ZeRO-2 formula with whole gradients", "ZeRO-2 holds 2 psi + 14 psi / N: here the formula "
      "keeps its gradients whole", ("table-1", "shares", "zero2-and-factors"), _zero2_formula_keeps_gradients_whole)


def _formula_adds_a_buffer():
    """Each device also holds a fixed buffer for communication (a 500 MB bucket of 16-bit gradients, as
    DeepSpeed's default reduce_bucket_size would give), whatever the model's size."""
    def model_state_bytes(original):
        def wrong(num_params, world_size, stage, *args, **kwargs):
            return original(num_params, world_size, stage, *args, **kwargs) + (2 * 5e8 if stage else 0)
        return wrong
    replace("zeronb.memory", "model_state_bytes", model_state_bytes)


world("06_memory", "a formula with a fixed buffer per device", "the model states per device scale with psi (the "
      "shares do not depend on it): here the formula adds a fixed 1 GB buffer to every ZeRO stage",
      ("table-1", "shares"), _formula_adds_a_buffer)


def _reduction_against_zero1():
    def reduction_factor(original):
        def wrong(world_size, stage, optimizer_bytes=12, param_bytes=2, grad_bytes=2):
            from zeronb.memory import model_state_bytes
            kw = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
            return model_state_bytes(1, world_size, 1, **kw) / model_state_bytes(1, world_size, stage, **kw)
        return wrong
    replace("zeronb.memory", "reduction_factor", reduction_factor)


world("06_memory", "reduction factors against ZeRO-1", "reduction factors are against DDP: here against ZeRO-1 "
      "(the note's '6-8x larger than ZeRO-1')", "zero2-and-factors", _reduction_against_zero1)


def _breakdown_shards_zero1_gradients():
    def breakdown(original):
        def wrong(num_params, world_size, stage, *args, **kwargs):
            out = original(num_params, world_size, stage, *args, **kwargs)
            if stage == 1:
                out["grads"] /= world_size
            return out
        return wrong
    replace("zeronb.memory", "model_state_breakdown", breakdown)


world("06_memory", "a breakdown that shards ZeRO-1's gradients", "ZeRO-1 keeps the gradients whole: here "
      "model_state_breakdown divides them by N", "stages-measured", _breakdown_shards_zero1_gradients)


def _sgd_momentum_counted_as_adam():
    def patch(m):
        m.OPTIMIZER_STATES["sgd-momentum"] = 2
    when_imported("zeronb.precision", patch)


world("06_memory", "SGD with momentum counted with two states", "SGD with momentum keeps one state per parameter: "
      "here zeronb.precision counts two, as Adam's", ("rules-of-thumb", "calculator"), _sgd_momentum_counted_as_adam)


# --- the calculator ---------------------------------------------------------------------------------------------

def _calculator_reads_any_suffix():
    def parse(original):
        import re

        def lenient(value):
            if isinstance(value, str):
                m = re.match(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)", value)
                value = f"{m.group(1)}{m.group(2)}" if m else value
            return original(value)
        return lenient
    replace("zeronb.book.calculator", "parse_num_params", parse)


world("06_memory", "a calculator that reads 7.5Q as 7.5", "a bad size is refused with a message: here the calculator "
      "drops a suffix it does not know", "calculator", _calculator_reads_any_suffix)


def _widget_not_wired():
    def memory_calculator(original):
        def unwired(*args, **kwargs):
            box = original(*args, **kwargs)
            for control in box.controls.values():
                control.unobserve_all("value")
            return box
        return unwired
    replace("zeronb.book.calculator", "memory_calculator", memory_calculator)


world("06_memory", "a calculator widget whose controls change nothing", "the widget follows its controls: here no "
      "control is observed", "calculator", _widget_not_wired)


# --- DeepSpeed's estimators -----------------------------------------------------------------------------------

def _deepspeed_zero2_without_fp32_grads():
    def estimate(original):
        def without(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
            cpu, gpu = original(total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
            return cpu, (gpu - 4 * total_params / (num_gpus_per_node * num_nodes) if not cpu_offload else gpu)
        return without
    replace("deepspeed.runtime.zero.stage_1_and_2", "estimate_zero2_model_states_mem_needs", estimate)


world("06_memory", "a DeepSpeed stage-2 estimate without fp32 gradients", "DeepSpeed's stage-2 estimate is zeronb's "
      "plus an fp32 gradient partition (4 psi / N): here it counts none", "deepspeed-estimators",
      _deepspeed_zero2_without_fp32_grads)


def _deepspeed_cpu_without_margin():
    def estimate(original):
        def without(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
            cpu, gpu = original(total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
            return cpu / additional_buffer_factor, gpu
        return without
    replace("deepspeed.runtime.zero.stage_1_and_2", "estimate_zero2_model_states_mem_needs", estimate)


world("06_memory", "a DeepSpeed CPU estimate without its margin", "DeepSpeed's stage-2 CPU term is 4 bytes per "
      "parameter per GPU of a node times 1.5: here without the 1.5", "deepspeed-estimators",
      _deepspeed_cpu_without_margin)


def _largest_layer_with_submodules():
    def model_to_params(original):
        def recursive(model):
            total = sum(p.numel() for p in model.parameters())
            largest = max(sum(p.numel() for p in m.parameters()) for m in model.modules() if m is not model)
            return total, largest
        return recursive
    replace("deepspeed.runtime.zero.stage3", "model_to_params", model_to_params)


world("06_memory", "a largest layer counted with its submodules", "DeepSpeed reads a model's largest layer as the "
      "most parameters one module owns itself: here with its submodules' (a whole block)", "deepspeed-estimators",
      _largest_layer_with_submodules)


def _causal_mask_from_a_buffer():
    """The causal mask as Hugging Face's GPT-2 builds it: a view of a 1024 x 1024 boolean buffer, which
    torch.where saves for backward whole (its storage), whatever the batch."""
    def patch(m):
        import math

        import torch
        import torch.nn.functional as F

        buffers = {}

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
            if x.device not in buffers:
                buffers[x.device] = torch.ones(1024, 1024, dtype=torch.bool, device=x.device).tril()
            causal = buffers[x.device][:t, :t]
            att = torch.where(causal, att, torch.finfo(att.dtype).min).softmax(dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))
        m.Block.forward = forward
    when_imported("zeronb.models", patch)


world("06_memory", "a causal mask that views a 1024 x 1024 buffer", "the activations that do not depend on the batch "
      "are small (a fixed global batch split N ways saves about 1/N each): here the causal mask is a view of a "
      "1 MiB buffer that autograd keeps", "activations", _causal_mask_from_a_buffer)
