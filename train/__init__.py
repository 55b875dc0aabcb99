"""Training code for the small default Clover (needs the `train` extra: torch, matplotlib)."""
