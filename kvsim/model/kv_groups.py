"""vLLM V1's KV cache groups: how a model's layers share one pool of blocks (vLLM 0.33.0,
vllm/v1/core/kv_cache_planning.py `get_kv_cache_groups`,
`_get_kv_cache_groups_uniform_page_size`, `get_kv_cache_config_from_groups`;
vllm/v1/kv_cache_interface.py `max_memory_usage_bytes`; vllm/v1/core/kv_cache_utils.py
`get_max_concurrency_for_kv_cache_config`).

A model whose layers all attend alike (full attention, or one sliding window on every
layer) has one group: a block is block_size tokens of every layer, and a request's one
block table serves them all. A hybrid model (gpt-oss: a 128-token window on every other
layer; Gemma 3: five 1,024-token local layers to one global) gets one table per group,
each group being the same number of layers of one kind, so that a block of any group
takes the same bytes and all groups draw block ids from one shared pool:

- the layers of each kind are counted; the group size is the smallest count (Gemma 3
  27B: 10 full, 52 sliding -> 10), or the largest where it is under 1.5 times the
  smallest (a drafter's extra layer: 12 sliding + 13 full -> 13);
- each kind splits into ceil(count / group size) groups (its last ones padded): Gemma 3
  27B has 6 sliding-window groups and 1 full-attention group, gpt-oss-20b 1 and 1, in
  the order the kinds first appear (both models start with a windowed layer);
- a block is block_size tokens of group-size layers, so the pool holds
  available // (group size x layer page) blocks: about twice a full-attention count for
  gpt-oss, 6.2 times for Gemma 3 27B;
- a request at max_model_len takes, from each full-attention group, ceil(L / block_size)
  blocks, and from each sliding-window group the window's admission cap (admission_cap); vLLM's "Maximum concurrency" is the pool's
  blocks over their sum.

kvsim.kvcache.hybrid (and hybrid_prefix, with prefix caching) holds a request's table per
group in a run. Only the same page
size in every layer is modelled (gpt-oss's and Gemma 3's layers all
have one KV shape); vLLM's packing of mixed page sizes, Mamba states and
`--disable-hybrid-kv-cache-manager` (which counts every layer as full) are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.model.specs import KVSpec, ModelSpec


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: `layers` layers (without padding) of one kind."""

    window: int | None  # None: full attention
    layers: int


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    group_size: int  # layers a block spans (padding included)
    num_layers: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def block_bytes(self, kv: KVSpec, block_size: int) -> float:
        """Bytes of one block: block_size tokens of group-size layers (of the whole
        model's KV heads; a tensor-parallel GPU holds its share)."""
        return block_size * kv.bytes_per_token / self.num_layers * self.group_size

    def blocks_per_request(self, block_size: int, max_model_len: int, in_flight_tokens: int) -> int:
        """Blocks a request at max_model_len takes from the pool, over all groups
        (get_max_concurrency_for_kv_cache_config)."""
        full = -(-max_model_len // block_size)
        return sum(
            full if g.window is None else admission_cap(g.window, block_size, in_flight_tokens, max_model_len)
            for g in self.groups
        )

    def describe(self) -> str:
        """The groups in a few words, for `kvsim memory`."""
        kinds: dict[int | None, int] = {}
        for g in self.groups:
            kinds[g.window] = kinds.get(g.window, 0) + 1
        parts = [
            f"{n} {'full-attention' if w is None else f'{w:,}-token window'} group{'s' * (n > 1)}"
            for w, n in kinds.items()
        ]
        return f"KV cache groups: {' + '.join(parts)} of {self.group_size} layers"


def admission_cap(window: int, block_size: int, in_flight_tokens: int, max_model_len: int) -> int:
    """Blocks a request must find free to be admitted, at most, in a windowed group (vLLM's
    SlidingWindowSpec.max_admission_blocks_per_request: a window may start inside a block)."""
    return -(-min(window - 1 + in_flight_tokens, max_model_len) // block_size) + 1


def kv_cache_groups(model: ModelSpec, hybrid: bool = True) -> KVGroups:
    """vLLM's KV cache groups for the model's layers; `hybrid` False: one group of every
    layer, a hybrid model's windowed layers counted as full (vLLM V0, which has no
    groups, and V1's --disable-hybrid-kv-cache-manager)."""
    if not (hybrid and model.is_hybrid):
        return KVGroups((KVGroup(model.sliding_window, model.num_layers),), model.num_layers, model.num_layers)
    window, sliding = model.hybrid_window, model.hybrid_window_layers
    # vLLM orders the kinds as their first layers come: gpt-oss's and Gemma 3's layer 0
    # attends to the window, so the sliding-window groups come first
    counts = [(window, sliding), (None, model.num_layers - sliding)]
    smallest, largest = min(n for _, n in counts), max(n for _, n in counts)
    size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for kind, n in counts:
        parts = -(-n // size)
        groups += [KVGroup(kind, len(range(i, n, parts))) for i in range(parts)]  # layers[i::parts]
    return KVGroups(tuple(groups), size, model.num_layers)
