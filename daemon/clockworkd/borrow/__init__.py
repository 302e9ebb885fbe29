"""Borrowed spares: the admin's policy, the choice of a preemptible job, and the privileged acquisition."""
