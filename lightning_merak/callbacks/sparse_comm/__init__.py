"""Sparse gradient communication for embedding tables: S2 Reducer and EmbRace.

``sketch`` and ``cost_model`` are pure tensor/Python code; ``s2_hook`` and
``embrace`` hold the collectives; ``callback`` wires them into Lightning.
"""

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication, data_parallel_group
from lightning_merak.callbacks.sparse_comm.cost_model import NetworkModel, TableTraffic, choose_method, method_costs
from lightning_merak.callbacks.sparse_comm.embrace import ShardedEmbedding, ShardedTiedHead, shard_embeddings
from lightning_merak.callbacks.sparse_comm.s2_hook import S2Reducer, s2_comm_hook
from lightning_merak.callbacks.sparse_comm.sketch import CountSketch, error_bound, failure_probability

__all__ = [
    "CommLedger",
    "CountSketch",
    "NetworkModel",
    "S2Reducer",
    "ShardedEmbedding",
    "ShardedTiedHead",
    "SparseCommunication",
    "TableTraffic",
    "choose_method",
    "data_parallel_group",
    "error_bound",
    "failure_probability",
    "method_costs",
    "s2_comm_hook",
    "shard_embeddings",
]
