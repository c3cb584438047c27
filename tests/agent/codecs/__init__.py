"""Codec tests: error bounds, fp8 bit compatibility with ml_dtypes, attention accuracy, registry."""
