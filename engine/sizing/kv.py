"""KV-cache arithmetic: bytes per token and per block, and how many blocks a memory budget buys.

Shared by the engine (sizing its pool at start-up) and by capacity planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ..core.units import cdiv
from ..models.registry import planning_family


@dataclass(frozen=True)
class KVLayout:
    """The per-token KV footprint of a model: K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, hf_config: object, dtype_bytes: int = 2) -> KVLayout:
        """The layout of a Hugging Face model config (16-bit KV by default)."""
        from ..models.layers import model_spec

        spec = model_spec(hf_config)
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def blocks_for_bytes(self, num_bytes: int, block_size: int) -> int:
        return num_bytes // self.bytes_per_block(block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """Sequences of `max_model_len` tokens the pool holds at once (vLLM's start-up figure)."""
    return num_blocks / cdiv(max_model_len, block_size)


def layout_from_config_dict(config: dict, dtype_bytes: int = 2) -> KVLayout:
    """The KV layout of a raw `config.json` mapping, for planning (nothing is built or checked
    against what the engine runs).

    Counts Llama-style decoders of any model_type: GQA through `num_key_value_heads`, an explicit
    `head_dim` when it is set (it need not be hidden / heads), and a nested `text_config`; where
    they are absent, what the config class of its `planning_family` assumes (a Llama's: every
    head, hidden / heads). Sliding windows are counted as full attention, as this engine caches
    every token.

    Raises:
        ValueError: a field is missing or not a positive integer, or the model compresses its KV
            (multi-head latent attention), which this formula does not describe.
    """
    cfg = config.get("text_config") or config
    if cfg.get("kv_lora_rank"):
        raise ValueError(
            "multi-head latent attention (kv_lora_rank) is not counted: K and V are not stored "
            "per KV head"
        )
    heads = _positive(cfg, "num_attention_heads")
    family, fields = planning_family(cfg.get("model_type")), SimpleNamespace(**cfg)
    kv_heads = family.read(fields, "num_key_value_heads") or heads
    head_dim = family.read(fields, "head_dim") or _positive(cfg, "hidden_size") // heads
    layers = _positive(cfg, "num_hidden_layers")
    for name, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
    return KVLayout(layers, kv_heads, head_dim, dtype_bytes)


def _positive(cfg: dict, name: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
    return value


def kv_budget_bytes(total_bytes: int, utilization: float, non_kv_bytes: int) -> int:
    """The KV budget the engine takes on a card: total x utilization, less what is not cache
    (weights and the profiled activation peak). May be zero or negative: nothing fits."""
    return int(total_bytes * utilization) - non_kv_bytes


def blocks_held(seq_len: int, block_size: int, window: int | None = None) -> int:
    """The most blocks a sequence holds on its way to `seq_len` tokens: every one, or with a
    sliding window (every layer attending to the last `window` positions) those from the block
    of its last query's first key on (`KVCacheManager.drop_out_of_window`): at most
    `window / block_size + 2`."""
    total = cdiv(seq_len, block_size)
    if window is None:
        return total
    return total - max(seq_len - window, 0) // block_size


def sequences_in_pool(
    num_blocks: int,
    block_size: int,
    seq_len: int,
    shared_prefix_tokens: int = 0,
    window: int | None = None,
) -> int:
    """Sequences of `seq_len` tokens a pool of `num_blocks` holds at once.

    With a shared prefix, its full blocks are held once for everyone and each sequence holds the
    rest of its own blocks (a prefix hit never covers a whole sequence: at least its last token
    is its own). With a sliding window longer sequences hold only their window's blocks
    (`blocks_held`); a shared prefix is then counted only where the window still covers it.
    """
    held = blocks_held(seq_len, block_size, window)
    dropped = cdiv(seq_len, block_size) - held
    shared = max(min(shared_prefix_tokens // block_size, (seq_len - 1) // block_size) - dropped, 0)
    own = held - shared
    return max(num_blocks - shared, 0) // own
