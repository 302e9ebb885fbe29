"""LinkPass: NIC failover for training traffic (planned: issue 5); nothing is implemented here yet."""
