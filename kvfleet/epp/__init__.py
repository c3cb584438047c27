"""kvfleet.epp."""
