"""Starting ranks: the local launcher, the Slurm node agents and their mesh, zygotes, the rank
proxy, borrowing and borrowed nodes' guests, a spare's warm-up. No torch: none of these modules imports it or
loads one that does (tests/unit/test_code_rules.py); the zygote process preloads it for the ranks it forks.
"""
