"""The prepared cache's one definition: its layout, files, checksums, per-item meta, the chain's fingerprint,
the sampling sets and the epoch order, which `prep` writes through and every reader reads through."""
