"""Tests of the node agent: tiers, codecs and the transfer engine."""
