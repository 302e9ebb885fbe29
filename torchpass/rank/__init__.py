"""A training rank: its context, step boundary, control thread, joining a generation, state
and its transfer, DDP and the collective backends. Imports torch."""
