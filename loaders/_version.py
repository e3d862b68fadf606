"""blockprep's version: a leaf module, imported by the package face and by what records versions."""

__version__ = "0.1.0"
