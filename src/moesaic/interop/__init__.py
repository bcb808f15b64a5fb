"""Conversions between moesaic layers and other libraries' MoE blocks."""
