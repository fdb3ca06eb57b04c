"""The graph interface of a bundle (docs/engine_io.md sections 2, 4.3, 5 and 5.1), declared once.

Every input and output of every network a bundle carries: its name (`{l}`: once per layer, owning layers for the
caches, every layer for the CPU graph's row caches), direction, element type, shape symbols and which networks carry
it. The builder declares its graphs' inputs and outputs from these ports and the backends feed and read them by
these names, so a name exists once; tests/test_graph_io.py checks every built network and docs/engine_io.md against
this table. Standard library only: the runtime imports it without numpy's or onnx's help.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

# the networks of a bundle (gsm.bundle_format.FILES names their files)
TRT, CPU, PORTABLE, DEMOTE, DEMOTE_PORTABLE = "trt", "cpu", "portable", "demote", "demote_portable"
IN, OUT = "in", "out"
LAYER = "{l}"


@dataclass(frozen=True)
class Port:
    """One graph input or output. `dtype` is ONNX's element type name (lower case, as TensorProto names it); a port
    whose type follows the bundle (indexer keys: FP16 or INT8 codes) lists each choice, `|`-separated."""

    name: str
    direction: str
    dtype: str
    shape: tuple[str, ...]
    graphs: frozenset[str]

    @property
    def prefix(self) -> str:
        """What every per-layer name starts with (`kv_pool.`), for telling a port's names from others'."""
        return self.name.split(LAYER)[0]

    def at(self, layer: int) -> str:
        return self.name.replace(LAYER, str(layer))


def _port(name: str, direction: str, dtype: str, shape: str, *graphs: str) -> Port:
    return Port(name, direction, dtype, tuple(shape.split()), frozenset(graphs))


_STEP = (TRT, CPU, PORTABLE)  # the networks a forward call runs
_KEYS = "float16|int32|int8"  # FP16 keys; INT8 codes four to an int32 word (pools) or one int8 each (portable)

INPUT_IDS = _port("input_ids", IN, "int64", "B S", *_STEP)
PAST_LENGTHS = _port("past_lengths", IN, "int32", "B", *_STEP)
NEW_LENGTHS = _port("new_lengths", IN, "int32", "B", *_STEP)
SPARSE_WINDOW = _port("sparse_window", IN, "int32", "1", *_STEP)
SPARSE_TOP_K = _port("sparse_top_k", IN, "int32", "B", *_STEP)
CACHE_ROWS = _port("cache_rows", IN, "int32", "B", *_STEP)
KV_SLOTS = _port("kv_slots", IN, "int32", "B N_max", TRT, CPU)
KV_POOL = _port("kv_pool.{l}", IN, "int32", "R P32", TRT, CPU, DEMOTE)
INDEX_KEYS = _port("index_keys.{l}", IN, _KEYS, "R N_max dI", *_STEP)
LOGIT_ROWS = _port("logit_rows", IN, "int32", "B J", *_STEP)
# 1: the call returns each owning layer's selection (`selected.{l}`), 0: [B, S, 0] (the CPU graph's nodes then
# keep it in scratch: ONNX Runtime holds every node output to the end of a run, read or not)
SELECTIONS = _port("selections", IN, "int32", "1", CPU)
ROW_CACHE = _port("row_cache.{l}", IN, "float", "R C kvD", CPU)
ROW_CACHE_TAGS = _port("row_cache_tags.{l}", IN, "int32", "R 3 C", CPU)
LATENT_K = _port("latent_k.{l}", IN, "float", "R N_max r_k", PORTABLE)
LATENT_V = _port("latent_v.{l}", IN, "float", "R N_max r_v", PORTABLE)
# the portable demotion graph takes the rows it re-encodes under the same names
DEMOTE_LATENT_K = replace(LATENT_K, shape=("M", "r_k"), graphs=frozenset({DEMOTE_PORTABLE}))
DEMOTE_LATENT_V = replace(LATENT_V, shape=("M", "r_v"), graphs=frozenset({DEMOTE_PORTABLE}))
K_ROWS = _port("k_rows.{l}", IN, "float", "R N_max kvD", PORTABLE)
DEMOTE_LIST = _port("demote_list", IN, "int32", "M 3", DEMOTE)
NEW_TIER = _port("new_tier", IN, "int32", "M", DEMOTE_PORTABLE)
POSITIONS = _port("positions", IN, "int32", "M", DEMOTE_PORTABLE)

LOGITS = _port("logits", OUT, "float", "B J V", *_STEP)
ATTN_MASS = _port("attn_mass", OUT, "float", "B L", *_STEP)
LAYER_MASS = _port("attn_mass.{l}", OUT, "float", "B L", *_STEP)
SELECTED = _port("selected.{l}", OUT, "int32", "B S K_sel", *_STEP)
QUERY_MASS = _port("query_mass", OUT, "float", "B J L", *_STEP)
KV_POOL_OUT = _port("kv_pool_out.{l}", OUT, "int32", "R P32", TRT, DEMOTE)
INDEX_KEYS_OUT = _port("index_keys_out.{l}", OUT, _KEYS, "R N_max dI", TRT)
NEW_LATENT_K = _port("new_latent_k.{l}", OUT, "float", "B S r_k", PORTABLE)
NEW_LATENT_V = _port("new_latent_v.{l}", OUT, "float", "B S r_v", PORTABLE)
NEW_INDEX_KEYS = _port("new_index_keys.{l}", OUT, _KEYS, "B S dI", PORTABLE)
NEW_K_ROWS = _port("new_k_rows.{l}", OUT, "float", "B S kvD", PORTABLE)
LATENT_K_OUT = _port("latent_k_out.{l}", OUT, "float", "M r_k", DEMOTE_PORTABLE)
LATENT_V_OUT = _port("latent_v_out.{l}", OUT, "float", "M r_v", DEMOTE_PORTABLE)
K_ROWS_OUT = _port("k_rows_out.{l}", OUT, "float", "M kvD", DEMOTE_PORTABLE)

PORTS = (INPUT_IDS, PAST_LENGTHS, NEW_LENGTHS, SPARSE_WINDOW, SPARSE_TOP_K, CACHE_ROWS, KV_SLOTS, KV_POOL, INDEX_KEYS,
         LOGIT_ROWS, SELECTIONS, ROW_CACHE, ROW_CACHE_TAGS, LATENT_K, LATENT_V, K_ROWS, DEMOTE_LIST, DEMOTE_LATENT_K,
         DEMOTE_LATENT_V, NEW_TIER, POSITIONS, LOGITS, ATTN_MASS, LAYER_MASS, SELECTED, QUERY_MASS, KV_POOL_OUT,
         INDEX_KEYS_OUT, NEW_LATENT_K, NEW_LATENT_V, NEW_INDEX_KEYS, NEW_K_ROWS, LATENT_K_OUT, LATENT_V_OUT, K_ROWS_OUT)


def ports_of(graph: str, direction: str | None = None) -> Iterator[Port]:
    """The ports network `graph` carries (in PORTS order), of one direction or both."""
    return (p for p in PORTS if graph in p.graphs and direction in (None, p.direction))
