"""The Moondream 3 family (3-preview, 3.1): a mixture-of-experts decoder over Moondream 2's
vision tower; see docs/moondream3.md."""
