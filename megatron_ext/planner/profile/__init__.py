"""Measured profiles (cluster collectives, per-layer samples) and the cost model they feed."""
