"""Chaos testing through Toxiproxy (chaos/README.md).

Home of the Toxiproxy-API server, the nemeses and the Jepsen-style runner. The chaos release
fills it; the package exists now so the layout shows where that work goes.
"""
