"""Node-silent verdicts: a peer node that fell silent on every fabric rail, whose kernel no longer answers, and
that another node's daemon also no longer hears, is dead; the jobs that ran on it are told at once.

``judge`` (the decision, pure), ``echo`` (the kernel probe), ``confirm`` (asking a second observer over the
daemons' CURVE socket), ``watch`` (the component the daemon hosts, which ties them together and tells the jobs),
``host`` (starting it in the daemon) and ``ops`` (``node_verdicts``, ``node_view``). Its settings, the
``[nodewatch]`` section, are ``clockwork.contracts.config.nodewatch``. See docs/architecture.md, "Node loss".
"""
