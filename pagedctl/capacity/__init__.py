"""`pagedctl capacity`: KV-cache capacity planning before any GPU is booked.

- `model`: KV bytes per token and weight bytes from a config (and safetensors headers);
- `card`: the card's memory and the engine's KV budget;
- `lengths`: length distributions and the lengths of a JSONL job;
- `plan`: the pool, sequences that fit, block-size waste (sections 1-3);
- `sim`: one arrival stream against three allocators, the engine's `BlockPool` among them;
- `probe`: the same figures measured on a GPU;
- `report`, `plot`, `recipe`, `cmd`: tables, files, charts, recipes and the command.
"""
