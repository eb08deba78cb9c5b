"""Chaos testing through Toxiproxy (DESIGN.md 4.7).

Home of the Toxiproxy-API server, the nemeses and the Jepsen-style runner. The chaos release
fills it; the package exists now so the layout shows where that work goes.
"""
