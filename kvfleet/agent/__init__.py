"""kvfleet.agent."""
