"""The plan as data (:class:`~autotp.planning.plan.Plan`), the checks that a plan applies to a
graph, constraints that pin placements, module blocks, and the Megatron reference plan."""
