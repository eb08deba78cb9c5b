"""Fault surveillance of recipients with alternative recipients (seed 001)."""
