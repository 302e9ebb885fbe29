"""The per-job coordinator: membership by generation, placement, lockstep, snapshot plans, and
the socket service around them. No torch (tests/unit/test_code_rules.py)."""
