"""Sparse gradient communication for embedding tables: S2 Reducer and EmbRace.

``sketch`` and ``wire_cost_model`` are pure tensor/Python code; ``s2_hook`` and
``embrace_exchange`` hold the collectives, ``embrace`` the sharded tables; ``callback`` wires them
into Lightning, with ``tables`` (finding them) and ``strategy_wiring`` (groups, DDP, probes).

Names are imported on first use, so the package costs nothing until a name is used.
"""

from lightning_merak.util.lazy import lazy_attributes

_EXPORTS = {
    "CommLedger": ".bytes_counter",
    "SparseCommunication": ".callback",
    "data_parallel_group": ".strategy_wiring",
    "NetworkModel": ".wire_cost_model",
    "TableTraffic": ".wire_cost_model",
    "choose_method": ".wire_cost_model",
    "method_costs": ".wire_cost_model",
    "ShardedEmbedding": ".embrace",
    "ShardedTiedHead": ".embrace",
    "shard_embeddings": ".embrace",
    "join_lookups": ".embrace",
    "S2Reducer": ".s2_hook",
    "s2_comm_hook": ".s2_hook",
    "SparseLookups": ".s2_hook",
    "CountSketch": ".sketch",
    "error_bound": ".sketch",
    "failure_probability": ".sketch",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_attributes(__name__, _EXPORTS)
