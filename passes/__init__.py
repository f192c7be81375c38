"""Graph passes of autotp: strategies -> cost -> solve (deciding), rewrite (applying).

- :mod:`.rules`: op -> candidate placements (one table, pure functions; a package by op
  family), and each op's rank-local form where it differs from the global one.
- :mod:`.grouped_query`: a captured graph's one-token grouped-query attention attends to the
  unrepeated KV cache (run by capture, before anything is planned).
- :mod:`.strategies`: every node's candidates (analysis; the FX graph is unchanged).
- :mod:`.costing`: predicted time/memory of every candidate and resharding.
- :mod:`.resharding`: one table from each resharding step kind to its price, its rewrite and
  its printed name and its adjoint (the steps themselves: ``autotp.base.reshard``).
- :mod:`.adjoints`: training graphs: each resharding route as one autograd node running the
  route forward and its adjoint backward, and Megatron's ``f`` for replicated inputs.
- :mod:`.solver`: exact MILP (HiGHS) choosing one candidate per node.
- :mod:`.uneven`: per-rank sizes of split dims (uneven splits), from the chosen candidates.
- :mod:`.rewrite`: a new rank-local GraphModule with local shapes and functional collectives.
"""
