"""Chapter 14's explanations of its verdicts: the book's sentences, kept apart from the rules that
compute the verdicts (zeronb.book.claims) so that each can be read, and changed, on its own.

WHY maps an explanation's name (a claim's key, or a variant its rule picks) to the verdict it
explains and its text. The table shows an explanation only beside that verdict: where the
measurements change a verdict, the sentence written for the old one is not left standing beside
it. Names in braces are the rule's measured values (`Finding.values`), filled in with
`str.format`. The text lives in a module, not a data file, so that it installs with the package.
"""

WHY = {
    "all-reduce": ("true", "the same result, and the same bytes with a real reduce-scatter (gloo's is an all-reduce, "
                           "so its two halves send {gloo_over_all_reduce:.2f}× its all-reduce)"),
    "all-reduce, not on the wire": ("true", "the same result (bytes: not counted under NCCL)"),
    "not on the wire": ("not measured", "under NCCL the operating system counts no GPU traffic; traffic verdicts "
                                        "need gloo"),
    "ring 2x": ("only when", "N is large: each rank sends 2(N−1)/N · S (plus gloo's message headers), {ring:.2f} S at "
                             "N = {n}, and within 5% of 2S only from N = 20 on: it tends to 2 as N grows, where "
                             "ZeRO-3's reduction (row 7) is N itself"),
    "sharded": ("false", "ZeRO-1 keeps every gradient (and, once it has reduce-scattered them, its summed shard on "
                         "top) and ZeRO-2 every parameter; the other notes' version is what was measured"),
    "sharded, neither": ("false", "neither version matches"),
    "percentages": ("only when", "the fractions depend on N and on the optimizer's bytes per parameter; by the formula, "
                                 "which the storage measured here matches, each number holds only in one setting "
                                 "({settings})"),
    "percentages, never": ("false", "the fractions depend on N and on the optimizer's bytes per parameter; by the "
                                    "formula, which the storage measured here matches, each number holds only in one "
                                    "setting ({settings}), never all three at one N"),
    "2+16/N": ("only when", "the reduced gradient shard is kept in fp32 (4 bytes) beside the 12 of the optimizer, as "
                            "DeepSpeed's step does with each averaged partition; the ZeRO paper's ZeRO-2 counts it in "
                            "fp16 (2 bytes, like bf16 here) and needs 2Ψ + 14Ψ/N"),
    "6-8x": ("false", "against ZeRO-1 it is at most (2+2)/2 = 2× for any N; 6–8× is against DDP, and only for large N "
                      "(at least 6× from N = {six_from}, 8× in the limit)"),
    "50x": ("only when", "N_d = 50: the reduction is the data-parallel degree N_d, whatever the precision"),
    "activations": ("only when", "it means ZeRO's data-parallel stages: every stage saved the same activations, from its own "
                                 "slice of the batch. ZeRO-R, in the same paper, partitions activation checkpoints "
                                 "across model-parallel ranks, which does save activation memory"),
    "zero2 all-reduce": ("false", "ZeRO-2 reduce-scatters, so each rank receives only its shard of the summed "
                                  "gradients: half an all-reduce's bytes"),
    "broadcast": ("false", "ZeRO-1 and ZeRO-2 all-gather the updated shards (PyTorch's ZeroRedundancyOptimizer "
                           "broadcasts them instead); ZeRO-3 sends nothing, as the next forward gathers what it needs"),
    "two gathers": ("only when", "an implementation frees every unit after its forward: zeronb keeps the last unit, "
                                 "whose backward follows at once ({z3}), and FSDP2 left to its default keeps the root "
                                 "module's own parameters (torch's _fsdp_state.py: \"For the root, do not reshard after "
                                 "forward\"); the GPT's root owns none, so FSDP2 gathers every unit twice here ({fsdp2})"),
    "1.5x": ("only when", "the reduce-scatter is a real one: two all-gathers and a reduce-scatter, 3(N−1)/N · Ψb "
                          "against 2(N−1)/N (a little less when the last unit is kept, as zeronb does); on gloo, "
                          "whose reduce-scatter is an all-reduce, FSDP2 sends about twice DDP's bytes"),
    "zero1 free": ("only when", "it reduce-scatters the gradients and all-gathers the parameters with a real "
                                "reduce-scatter (gloo's own is an all-reduce: {z1_gloo:.2f}×). PyTorch's "
                                "ZeroRedundancyOptimizer sends {torch_z1:.2f}× DDP's bytes: its broadcasts cost about "
                                "what ZeRO-1's all-gather does (chapter 8), and the excess is DDP's whole all-reduce "
                                "of the gradients, where a reduce-scatter would do"),
    "note 000 ring": ("false", "a ring needs N − 1 = {steps} steps per pass, and with rank r sending shard r first, "
                               "rank r ends with shard r + 1 (zeronb's ring sends shard r − 1 first, so that rank r "
                               "ends with shard r)"),
    "note 001 code": ("false", "ZeRO shards a flat buffer into N equal chunks (chapter 8); the pseudo-code hands the "
                               "reduce-scatter one input per parameter ({parameters}), where it takes a list of "
                               "world-size length ({ranks}), input i shaped like rank i's output: {uneven}"),
    "fsdp groups": ("only when", "compared with a ZeRO-3 that gathers layer by layer (DeepSpeed's stage 3 does, one "
                                 "module at a time, with the settings zeronb gives it; by default it gathers several "
                                 "modules in one coalesced all-gather, up to stage3_prefetch_bucket_size, and keeps "
                                 "tensors under stage3_param_persistence_threshold whole): grouping a block's "
                                 "parameters into one collective cuts the calls, and the fixed cost of each, for "
                                 "nearly the same bytes ({same_bytes:.3f}× on the wire, the excess gloo's headers on "
                                 "more messages). It is the wrapping that saves, not FSDP: "
                                 "zeronb's ZeRO-3 groups by block too, and then makes FSDP2's calls and sends its bytes"),
    "fsdp groups, not on the wire": ("only when", "compared with a ZeRO-3 that gathers layer by layer: grouping cuts "
                                                  "the calls (the bytes are not counted under NCCL)"),
    "memory for bytes": ("only when", "stage 3: stages 1 and 2 save memory at no cost in bytes; only stage 3 pays "
                                      "with about 1.5× the traffic"),
    "two halves": ("only when", "it means traffic, and the naive all-reduce is named: against the one through a rank "
                                "the busiest rank sends less ({busiest:.2f}×) but all ranks together send the same "
                                "({total:.2f}×: the ring spreads them evenly); against the direct one, every rank its "
                                "tensor to every other, (N − 1)S a rank, every rank sends less ({direct:.2f}×). No "
                                "memory is saved: both end with the whole reduced tensor on every rank, unless one "
                                "stops after the reduce-scatter and keeps the shard (ZeRO-2)"),
    "zero1 order": ("false", "the order holds but the operations are swapped: the gradients are reduce-scattered (each rank gets its summed shard) as "
                             "backward ends, and the updated weights all-gathered after the optimizer step"),
    "master copy": ("only when", "read as \"bf16 weights alone will do\": when the training tolerates updates that "
                                 "bf16 cannot resolve. Read as \"one fp32 copy will do\", it holds: keep only the fp32 "
                                 "weights and cast them to bf16 for each use, and no update is lost ({master_lost} here). That is "
                                 "cheap only where the fp32 weights are sharded: FSDP2's MixedPrecisionPolicy "
                                 "(param_dtype) casts each rank's fp32 shard and gathers it in bf16; ZeRO-1, whose "
                                 "weights are replicated, would hold 4Ψ bytes of them per rank instead of 2Ψ + 4Ψ/N "
                                 "(bf16 weights and an fp32 shard), and all-gather fp32 after the step, twice the "
                                 "bytes"),
}
