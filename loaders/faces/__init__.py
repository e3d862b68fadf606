"""The faces for torch, MONAI and DALI: `PreparedDataset`, `PreparedBatches`, `PreparedPersistentDataset`,
`CacheSource`, `FileSource`, `BmapSource`."""
