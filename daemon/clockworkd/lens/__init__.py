"""Fleet Lens: NIC-pair probing, software clock sync, one-way delays and gray-failure localization.

Modules (each small, each with one job):

- ``clockwork.contracts.lens_model``: the value types every other module speaks (NIC and link names, path
  statistics, verdicts, suspects), and the CLI and the audit too; its settings are
  ``clockwork.contracts.config.lens`` (the ``[lens]`` section).
- ``topology``: which NIC hangs on which switch port, the links between switches, and the directed
  links a probe between two NICs crosses.
- ``peers``: which peer NICs each NIC probes (all on small clusters; K per NIC on large ones, chosen
  so every link can be singled out).
- ``tomography``: the smallest set of directed links that explains the bad paths.
- ``clockpair``, ``clockgraph``, ``clockseam``: software clock sync. Pairwise clock offset and drift
  from one-way delay envelopes; least squares over the probe graph; the synthetic clocks tests give
  each emulated node.
- ``wire``/``fastio``: the probe packets and batched kernel I/O. ``_probeio`` (C, sources in ``csrc/``)
  does the per-packet work: build, tag and send probes and trains; receive, verify and parse them
  (wire.py is its reference).
- ``prober``: the component the node daemon hosts in its event loop, which runs the parts below.
  ``probepaths``: a node's NICs, the paths each probes and receives, and the arrays the C side shares;
  ``receiving``: reading what arrives and filing it; ``clockkeeper``: this node's view of every clock;
  ``summaries``: what the daemons tell each other; ``suspects``: raising, clearing and announcing links.
- ``host``: starting it in the daemon; ``ops``: the ``lens`` op. ``history`` and ``metrics``: HDF5 and Prometheus.
"""
