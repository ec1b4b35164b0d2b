"""ddtree: lossless tree speculative decoding (DFlash drafter + DDTree), served on Ray Serve."""

__version__ = "0.1.0"
