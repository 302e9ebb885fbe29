"""LinkPass hosted by the node daemon: its engine (the top-level ``linkpass`` package) started
and fed by the daemon, its fail-over state kept under the daemon's state folder."""
