"""Pure core of the MoE plugin: placement, cost model, planners, chunk choice, exchange layout.

Plain Python and torch over counts and tensors: no process groups, no DeepSpeed, so each piece
is tested on one process and the layer, executor and callback above it stay thin. ``placement``
(plans and token accounting), ``placement_cost_model`` (the latency model), ``placement_planner``
(Pro-Prophet), ``shadowing`` (the FasterMoE baseline), ``step_planner`` (one search space over
them, per call, on that call's counts), ``plan_check`` (its predictions corrected by measured
layer time), ``lancet`` (chunk-count simulation),
``dispatch`` (exchange-buffer layout, encode/decode) and ``joint_gate`` (whole-batch gating of
sub-batches).
"""
