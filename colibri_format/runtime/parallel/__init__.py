"""Expert parallelism: every rank owns a disjoint share of each MoE layer's experts (docs/expert_parallel.md).

placement.py decides who owns what, ep.py moves token rows between ranks with torch.distributed collectives,
engine.py wraps the NumPy engine so that all ranks run one forward pass in lockstep, launch.py starts the
ranks. torch is imported only by the modules that need it, so `placement` stays pure Python + NumPy.
"""
