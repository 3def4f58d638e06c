"""The engine's torch-free core: what runs where, and which KV blocks hold it.

Settings (`config`), requests as sequences and beam groups, the block pool and its hashes, the KV
cache manager (prefix cache, copy-on-write), the swap policy and the scheduler. Nothing here
imports torch (tests/test_layering.py): `pagedctl capacity` simulates on these very classes.
"""
