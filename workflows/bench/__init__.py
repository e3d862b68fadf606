"""The benchmark behind `python -m workflows.benchmark`: harness (core), ceilings, research loaders, peers,
blockprep's own ways (ours) and the table/CSV/JSON/PNG report."""
