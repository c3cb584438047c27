"""kvfleet.demo: the one-machine stack and its report."""
