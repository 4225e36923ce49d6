"""Multi-device roles: `--num-gpus N` runs N ranks (CFG parallel, Ulysses, Ring) behind one worker.

layout (which rank holds what), mesh (torch.distributed groups), jobs (rank 0 -> followers),
attention (sequence-parallel attention), families (what each model family supports and how its
sequence is sharded), ranks (starting, watching and running the ranks), follower (entry point).
"""
