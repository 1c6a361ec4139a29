"""Speculative decoding: the jitted rounds (draft, build, verify, accept, commit), the DDTree
tree, sampling, request checks and the host engine that buckets, runs and streams requests."""
