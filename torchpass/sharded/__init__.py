"""Sharded training: FSDP2/HSDP states and meshes, and the peer copies that rebuild a lost
shard (its sealed stream). Imports torch."""
