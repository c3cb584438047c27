"""The KV-cache core: block hashing, block pool and manager, radix tree, KV events, tiers.

Imports nothing above it (checked by import-linter); every other layer builds on it.
"""
