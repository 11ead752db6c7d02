"""The minimal versions: each algorithm of the course in one short module, and nothing else.

Read these first. Each is what a chapter teaches, written for reading in one sitting: no
observers, no replicas, no ZeRO++, no mixed precision, no gradient accumulation, one
version shim at most. The full engines (zeronb.collectives.ring, zeronb.zero) do the same
communication on the same layout and add what a course that measures needs; the tests hold
each minimal version to its full engine, value for value and collective for collective
(tests/test_minimal.py).

    ring.py    reduce-scatter, all-gather and all-reduce by hand, from sends and receives (chapter 4)
    ddp.py     bucketed gradient all-reduce, overlapped with backward (chapter 7)
    zero1.py   ZeRO-1: the optimizer state sharded (chapter 8)
    zero2.py   ZeRO-2: the gradients sharded too, bucket by bucket during backward (chapter 9)
    zero3.py   ZeRO-3: the parameters sharded too, gathered unit by unit (chapter 10)

Every engine wraps a model and builds the optimizer it needs from a function of the parameters
it updates; one step is forward, backward, `engine.step()`:

    engine = ZeRO1(model, lambda params: torch.optim.SGD(params, lr=0.1))
    model.loss(model(x), y).backward()
    engine.step()

A layer of its own: it imports nothing of zeronb but the version shims (zeronb.runtime.compat).
"""
