"""The runner: one scheduled step on the device.

Block tables and staging buffers, the model runner (prepare, forward, sample), step graphs
(CUDA graphs), the host KV copy for swap, the sampler, and the containment of a failed step.
"""
