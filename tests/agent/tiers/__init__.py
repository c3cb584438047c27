"""Tier tests: stores, SSD restart, Redis tier on a real server, policy, promotion rule, metrics, failures."""
