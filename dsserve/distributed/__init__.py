"""Parallel execution on torch.distributed (issue 54): process groups, the collectives the model needs (each beside
its single-process reference), and the passes that shard the single-process model for tensor and expert
parallelism. The model and its reference forward stay single-process; these modules change a built model in place.
"""
