"""Borrowed spares: the admin's policy, the choice of a preemptible job, and the privileged acquisition.

``host`` starts the manager in the daemon and ``ops`` answers ``borrow``, ``borrow_status`` and ``borrow_release``;
the ``[borrow]`` section is ``clockwork.contracts.config.borrow`` and the AdminComments
``clockwork.contracts.borrow_comments`` (the Epilog writes them too)."""
