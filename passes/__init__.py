"""Graph passes of autotp: strategies -> cost -> solve (deciding), rewrite (applying).

- :mod:`.rules`: op -> candidate placements (one table, pure functions).
- :mod:`.strategies`: every node's candidates (analysis; the FX graph is unchanged).
- :mod:`.costing`: predicted time/memory of every candidate and resharding.
- :mod:`.solver`: exact MILP (HiGHS) choosing one candidate per node.
- :mod:`.partition`: per-rank sizes of split dims (uneven splits), from the chosen candidates.
- :mod:`.rewrite`: a new rank-local GraphModule with local shapes and functional collectives.
"""
