"""Synthetic grids: seeded Q/K/V, the sweep's measurements, its theory (torch-free), published figures."""
