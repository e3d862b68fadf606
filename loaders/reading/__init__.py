"""The read path: a cache's tensors (or regions of them) and whole files into host or device buffers through one
backend call, and staged where the batch is made."""
