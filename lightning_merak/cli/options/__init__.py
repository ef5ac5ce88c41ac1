"""Typed options of ``merak-train``'s feature config groups, one module per group.

Each module declares the schema dataclasses of its group's options (``strategy=merak3d``,
``memory=delta``, ``comm=s2``, ``adapter=qbara``, ``moe=prophet``, …) and registers them with
Hydra. They import nothing heavy at module level — the feature behind an option is imported
when the option builds it — so composing a configuration or printing ``--help`` is quick.
"""
