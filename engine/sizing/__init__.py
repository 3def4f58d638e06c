"""Sizing: the device and dtype, KV bytes per token and block, and the pool a memory budget buys
(profiled on CUDA, from the free memory on the CPU).
"""
