"""The simulator: virtual-time replay of traces through the live code."""
