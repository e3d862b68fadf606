"""Block maps: where a file's bytes lie on its block device (`bmap.json`, FIEMAP)."""
