"""The fast path: `PreparedLoader` and its rooms (assembly of a batch, device tier, folded crops, head values,
exactness against MONAI, loader state, the feeder process)."""
