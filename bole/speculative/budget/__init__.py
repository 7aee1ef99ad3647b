"""The verification budget: which drafted nodes a round verifies.

    policy.py        the BudgetPolicy protocol the round runner calls, and what the policies share
    registry.py      every policy by name (fixed, global, calibrated, goodput)
    fixed.py, global_budget.py, calibrated.py, goodput.py   the policies
    round_select.py  the device side of a select round (the selection compacted to a width)
    ranking.py       rank order, the batch-shared selection, compaction
    expected.py      expected accepted tokens and goodput's width choice
    widths.py        verify width buckets and their prices
    draft_depth.py   goodput's draft depth for whole rounds
    profile.py       a GPU's calibration profile (T_dec, T_ver, B_ver)
    acceptance.py    acceptance against rho, learnt online
"""
