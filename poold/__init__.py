"""poold: CXL and far-memory pooling."""

__version__ = "0.1.0"
