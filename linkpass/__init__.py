"""LinkPass: a dead or gray NIC's traffic moves to the node's other NICs in well under a second, and back.

Hosted by the node daemon (``clockworkd``), which gives it a fabric map, a key and a way to publish
events; linkpass itself imports nothing of clockworkd (dependency direction linkpass <- clockworkd).
"""
