"""Models: the family registry (`registry`, torch-free), configs read without transformers
(`config`), where weights come from (`source`, `weights`, `gguf`, `cache`), and the decoder that
runs the families on the paged KV cache (`llama`, its `layers` and `attention`).
"""
