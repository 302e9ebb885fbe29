"""Node-silent verdicts: a peer node that fell silent on every fabric rail, whose kernel no longer answers, and
that another node's daemon also no longer hears, is dead; the jobs that ran on it are told at once.

``settings`` (the ``[nodewatch]`` section), ``judge`` (the decision, pure), ``echo`` (the kernel probe),
``confirm`` (asking a second observer over the daemons' CURVE socket) and ``watch`` (the component the daemon
hosts, which ties them together and tells the jobs). See docs/architecture.md, "Node loss".
"""
