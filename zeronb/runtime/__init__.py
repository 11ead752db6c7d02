"""The runtime: what every rank stands on, whatever it teaches.

    compat.py    what differs between torch versions (2.4 to 2.13), in one place
    backend.py   which backend and device a rank uses (gloo on CPU, NCCL on its own GPU), joining the group
    topology.py  ranks on nodes (node-major, as torchrun numbers them), and link rates
    sockets.py   this rank's TCP connections: which are open, bytes the kernel sent on each, pacing
    links.py     which rank is at the other end of each connection, and the paced links between nodes
    groups.py    every process group and device mesh zeronb makes (shards, replicas, nodes), once per world
                 (FSDP2 resharding to a node makes its own, inside fully_shard: see groups.py)

The lowest layer: imports torch and the standard library only, nothing else of zeronb.
"""
