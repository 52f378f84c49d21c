"""Bulk work: requests read from files rather than connections (``vlm batch``, the Batch API)."""
